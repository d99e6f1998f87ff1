"""The rankscope version, read by packaging and written into every manifest."""

__version__ = "0.1.0"
