"""The outside of tierfs: command line, configuration, daemon life cycle, control socket,
status and the demo. This package wires the other parts together."""
