"""neuron_inductor: a torch.compile backend for AWS Trainium.

`torch.compile(model, backend="neuron")` works after `pip install` without importing this
package (the `torch_dynamo_backends` entry point); import it for the Python API.
"""

__version__ = "0.1.0"
