"""Definition-driven harness: definition -> workloads -> solution -> judge / timing -> trace -> report."""


class HarnessError(Exception):
    """A user-facing error: its message is one line that names the file and the field at fault."""
