"""Export a run's winners: the writer (writer.py) and the files it ships into the export folder (runtime/)."""

from agent.export.writer import ExportLine, export_run, recheck

__all__ = ["ExportLine", "export_run", "recheck"]
