"""Hub: receives, validates, aligns, stores and records what the collectors send.

Modules, in the order a message meets them:

- `server`: the `Hub` — ZeroMQ PULL for data, ROUTER for clock pings, receive threads;
- `intake`: decode, validate (`validate`), record (`recording`), store — the one path live
  messages and replayed recordings share;
- `store` (with `runstate`, `pending`, `matching`, `blockset`, `columns`): the live numpy
  store; ``Store.window(run)`` gives the `Window` every analysis consumes; `allocator` keeps the
  matching pass's temporaries in the heap;
- `recording`: the versioned append-only file format, its writer and tolerant readers;
- `replay`: a store rebuilt from a recording, once or following it as it grows;
- `inspection`: the ``rankscope inspect`` report of a recording;
- `export_csv`, `export_perfetto`, `prometheus`: views of store windows for other tools.
"""
