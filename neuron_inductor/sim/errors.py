"""Errors raised by the NKI interpreter."""

from __future__ import annotations


class NkiError(Exception):
    """Any error the interpreter raises about a kernel (bad API use, unsupported feature)."""


class NkiValidationError(NkiError):
    """nki.isa.NkiValidationError: raised when hardware constraints are violated (every rule error is one)."""


class NkiNotModelledError(NkiError, NotImplementedError):
    """A documented API the interpreter does not execute (the MX instructions of NeuronCore-v4)."""


class NkiRuleError(NkiValidationError):
    """A hardware rule of nki-reference.md §2 was broken.

    `.op` is the API call ("nisa.nc_matmul"), `.rule` the rule in short form
    ("partition dim <= 128") and `.value` the offending value.
    """

    def __init__(self, op: str, rule: str, value, message: str):
        super().__init__(f"{op}: {message} (rule: {rule})")
        self.op = op
        self.rule = rule
        self.value = value


class NkiCapacityError(NkiRuleError):
    """Live SBUF or PSUM bytes per partition exceed the target's capacity."""


class NkiIndexError(NkiError, IndexError):
    """A slice or index falls outside a tensor."""
