"""neuron_inductor: a torch.compile backend for AWS Trainium.

`torch.compile(model, backend="neuron")` works after `pip install` without importing this
package (the `torch_dynamo_backends` entry point); import it for the Python API.
"""

__version__ = "0.1.0"

from .cache import cache_stats  # noqa: E402  (after __version__, which the cache key reads)


def report():
    """What this process compiled: kernels, fallbacks, share of FLOPs in kernels, padding waste and
    estimated Trn2 time per kernel and graph (`print(neuron_inductor.report())`; see observe/report.py)."""
    from .observe import report as process_report

    return process_report()


from .nki_ops import nki_op, wrap_nki  # noqa: E402  (users' own NKI kernels as custom ops)
from .process_state import reset  # noqa: E402  (forget every process-wide store)
