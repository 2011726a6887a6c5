"""See and explain what the compiler did: logs, kernel dumps, verify mode, the report, progress.

The pipeline calls the hooks in `hooks.py`; users call `report()` (also `neuron_inductor.report()`)
and the `neuron-inductor` console script (`neuron_inductor/cli.py`).
"""

from .hooks import on_dynamo_graph, on_graph_runner, on_program_compiled, on_program_dropped, on_run
from .logs import register_with_torch_logging
from .records import GraphRecord, ProgramRecord
from .report import Report, dump_report, process_report as report
from .verify import VerifyError

register_with_torch_logging()

__all__ = ["GraphRecord", "ProgramRecord", "Report", "VerifyError", "dump_report", "on_dynamo_graph",
           "on_graph_runner", "on_program_compiled", "on_program_dropped", "on_run", "report"]
