"""Bad input: invalid option values, dtypes the target has no type for, NaN and Inf.

- every option rejects a bad value, through `options=` and through its environment variable, with
  an error that names the option (or variable) and what is accepted;
- float64 and complex graphs: Trainium has no fp64 (or complex) on chip, so their ops must not run
  in fp32 kernels. They fall back to eager ATen on the host, visibly (the reason names the dtype),
  with bit-identical results; fallback="error" refuses them;
- NaN and +-Inf propagate through pointwise, reduction, matmul and softmax kernels as in eager, in
  fp32 and bf16 (every op runs as a kernel: fallback="error"); arg-reductions over a row holding
  NaN point at its first NaN, as eager does.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from neuron_inductor import config
from neuron_inductor.observe import session
from neuron_inductor.toolchain.neuron import ToolchainUnavailable


@pytest.fixture(autouse=True)
def fresh_dynamo(tmp_path):
    torch._dynamo.reset()
    with config.patch(cache_dir=str(tmp_path / "cache")):
        yield
    torch._dynamo.reset()


def _first_call_error(fn, *args, **compile_kwargs) -> BaseException:
    """The error the first call of the compiled `fn` raises, unwrapped from Dynamo's BackendCompilerFailed."""
    with pytest.raises(Exception) as raised:
        torch.compile(fn, backend="neuron", **compile_kwargs)(*args)
    return getattr(raised.value, "inner_exception", raised.value)


# -- option values -------------------------------------------------------------------------------

# One invalid value per validated option, and what the error must list as accepted.
BAD_VALUES = {
    "toolchain": ("gpu", "accepted values: auto, simulator, neuron"),
    "target": ("trn4", "accepted values: trn1, trn2, trn3"),
    "fallback": ("sometimes", "accepted values: warn, allow, error"),
    "buckets": ("128,64", "accepted: 'N' (next multiple of N"),
    "verify": ("loud", "accepted values: off, warn, raise"),
    "raise_recompile_limit": ("maybe", "accepted values: 1/0, true/false, yes/no, on/off"),
}
FREE_TEXT_OPTIONS = {"cache_dir", "dump_dir", "cache_secret"}  # any string is a path / a secret


def test_every_validated_option_has_a_bad_value_case():
    assert set(BAD_VALUES) | FREE_TEXT_OPTIONS == set(config.NeuronConfig.option_names())


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_bad_option_value_through_torch_compile_says_what_is_accepted(name):
    value, accepted = BAD_VALUES[name]
    error = _first_call_error(lambda x: x * 2, torch.randn(3), options={name: value})
    assert isinstance(error, config.ConfigError)
    assert f"option {name}={value!r}" in str(error) and accepted in str(error)


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_bad_environment_value_names_the_variable_and_what_is_accepted(name, monkeypatch):
    value, accepted = BAD_VALUES[name]
    variable = next(env for option, env, _, _ in config.describe_options() if option == name)
    monkeypatch.setenv(variable, value)
    error = _first_call_error(lambda x: x * 2, torch.randn(3))
    assert isinstance(error, config.ConfigError)
    assert f"environment variable {variable}" in str(error) and accepted in str(error)


@pytest.mark.parametrize("policy", ["0", "-128", "128,128", "256,128", "128:64", "64:100", "3.5", "abc", "",
                                    [128, 256]])
def test_bad_bucket_policies_are_rejected(policy):
    with pytest.raises(config.ConfigError, match=r"bad bucket policy .*accepted: 'N'"):
        config.resolve({"buckets": policy})


@pytest.mark.parametrize("options, field, parsed", [
    ({"buckets": " 128 "}, "buckets", "128"),
    ({"buckets": 256}, "buckets", "256"),
    ({"fallback": "ERROR"}, "fallback", "error"),
    ({"verify": True}, "verify", "warn"),
    ({"verify": "1"}, "verify", "warn"),
    ({"raise_recompile_limit": "off"}, "raise_recompile_limit", False),
    ({"cache_dir": ""}, "cache_dir", None),
])
def test_lenient_spellings_parse_to_canonical_values(options, field, parsed):
    assert getattr(config.resolve(options), field) == parsed


def test_options_must_be_a_dict():
    with pytest.raises(config.ConfigError, match="options must be a dict, got str"):
        config.resolve("fallback=warn")


def test_neuron_toolchain_without_the_real_nki_says_how_to_run_here():
    error = _first_call_error(lambda x: x * 2, torch.randn(3), options={"toolchain": "neuron"})
    assert isinstance(error, ToolchainUnavailable)
    assert "needs the real `nki` package" in str(error) and "NEURON_INDUCTOR_TOOLCHAIN=simulator" in str(error)


# -- dtypes without an on-chip type ----------------------------------------------------------------

FLOAT64_CASES = {
    "pointwise": lambda x: x * 2 + 1e-12,  # fp32 math would drop the 1e-12 and round x
    "exp": lambda x: torch.exp(x) - 1,
    "sum": lambda x: x.sum(-1),
    "matmul": lambda x: x @ x.T,
    "softmax": lambda x: torch.softmax(x, dim=-1),
    "cat": lambda x: torch.cat([x, x + 1e-12]),
}
COMPLEX_CASES = {
    "pointwise": lambda z: z * z + 1j,
    "abs": lambda z: z.abs(),
    "sum": lambda z: z.sum(-1),
    "matmul": lambda z: z @ z.T,
}


def _assert_host_fallback_like_eager(fn, x: torch.Tensor, dtype_name: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="neuron_inductor"):
        got = torch.compile(fn, backend="neuron")(x)
    want = fn(x)
    assert got.dtype == want.dtype and torch.equal(got, want)  # the same ATen calls on the host: bit-exact
    meta = session.BUCKETS[-1].artifact.meta
    assert meta["kernels"] == [] and meta["fallbacks"]  # nothing of it ran in an (fp32) kernel
    fallback_lines = [line for line in caplog.text.splitlines() if "runs eagerly on the host" in line]
    assert len(fallback_lines) == len(meta["fallbacks"])
    assert all(dtype_name in line for line in fallback_lines), fallback_lines


@pytest.mark.parametrize("case", sorted(FLOAT64_CASES))
def test_float64_runs_on_the_host_in_float64(case, caplog):
    x = torch.randn(6, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    _assert_host_fallback_like_eager(FLOAT64_CASES[case], x, "float64", caplog)


@pytest.mark.parametrize("case", sorted(COMPLEX_CASES))
def test_complex_runs_on_the_host(case, caplog):
    z = torch.randn(6, 6, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    _assert_host_fallback_like_eager(COMPLEX_CASES[case], z, "complex64", caplog)


def test_float64_training_step_matches_eager_in_float64_precision():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 20), torch.nn.GELU(), torch.nn.Linear(20, 3)).double()
    x, y = torch.randn(9, 12, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)
    F.mse_loss(model(x), y).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with config.patch(fallback="allow"):
        F.mse_loss(torch.compile(model, backend="neuron")(x), y).backward()
    # Decompositions reorder a few sums, so not bit-exact; fp32 anywhere would show as ~1e-7 errors.
    for got, expected in zip((p.grad for p in model.parameters()), want):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_fallback_error_mode_refuses_dtypes_without_a_kernel(dtype):
    x = torch.randn(4, 8, dtype=dtype)
    error = _first_call_error(lambda t: (t * 2).sum(-1), x, options={"fallback": "error"})
    message = str(error)
    assert "have no NKI kernel" in message and "aten.mul.Tensor" in message and "aten.sum" in message
    assert str(dtype).removeprefix("torch.") in message


@pytest.mark.xfail(strict=True, reason="int64 values travel through int32 tiles on chip: values beyond the int32 "
                                       "range saturate silently (2**40 + 1 comes back as 2**31 - 1)")
def test_int64_values_beyond_int32_are_not_silently_saturated():
    x = torch.tensor([2 ** 40, 5, -(2 ** 35)])
    got = torch.compile(lambda t: t + 1, backend="neuron")(x)
    assert torch.equal(got, x + 1)


# -- NaN and Inf ------------------------------------------------------------------------------------

ROWS, COLS = 130, 70  # two partition tiles (128 + 2 rows), a free dim that is no multiple of a tile


def _with_specials(dtype: torch.dtype) -> torch.Tensor:
    """Random values with NaN, +Inf and -Inf in both partition tiles, and one all -Inf row."""
    x = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0))
    x[1, 3] = x[129, 10] = float("nan")
    x[5, 0] = x[128, 69] = float("inf")
    x[7, 69] = x[60, 30] = float("-inf")
    x[9, :] = float("-inf")
    return x.to(dtype)


SPECIAL_CASES = {
    # pointwise
    "add": lambda x, y: x + y,
    "mul_by_zero": lambda x, y: x * 0,
    "exp": lambda x, y: x.exp(),
    "relu": lambda x, y: x.relu(),
    "maximum": lambda x, y: torch.maximum(x, y),
    "minimum": lambda x, y: torch.minimum(x, y),
    "clamp": lambda x, y: x.clamp(-1, 1),
    "sigmoid": lambda x, y: x.sigmoid(),
    "tanh": lambda x, y: x.tanh(),
    "silu": lambda x, y: F.silu(x),
    "rsqrt": lambda x, y: x.rsqrt(),
    "divide": lambda x, y: y / x,
    "where": lambda x, y: torch.where(x > 0, x, y),
    # reductions
    "sum": lambda x, y: x.sum(-1),
    "sum_over_rows": lambda x, y: x.sum(0),
    "mean": lambda x, y: x.mean(-1),
    "amax": lambda x, y: x.amax(-1),
    "amin": lambda x, y: x.amin(-1),
    "amax_over_rows": lambda x, y: x.amax(0),
    "max_values": lambda x, y: x.max(-1).values,
    "var": lambda x, y: x.var(-1),
    # matmul
    "matmul": lambda x, y: x @ y.T,
    "matmul_transposed": lambda x, y: x.T @ y,
    # softmax
    "softmax": lambda x, y: x.softmax(-1),
    "log_softmax": lambda x, y: x.log_softmax(-1),
}
INDEX_CASES = {
    "argmax": lambda x, y: x.argmax(-1),
    "max_indices": lambda x, y: x.max(-1).indices,
}
# bf16 keeps 8 mantissa bits; kernels and eager round at different points (one or two bf16 ulps).
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(SPECIAL_CASES))
def test_nan_and_inf_propagate_as_in_eager(case, dtype):
    fn = SPECIAL_CASES[case]
    x = _with_specials(dtype)
    y = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = fn(x, y)
    assert not torch.isfinite(want).all()  # the case really carries NaN or Inf to its result
    with config.patch(fallback="error"):  # every op runs in a kernel
        got = torch.compile(fn, backend="neuron")(x, y)
    # equal_nan: NaN exactly where eager has NaN; infinities must match in place and sign.
    scale = want.float().nan_to_num(posinf=0, neginf=0).abs().max().clamp(min=1).item()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), equal_nan=True, rtol=tol["rtol"], atol=tol["atol"] * scale)


@pytest.mark.parametrize("case", sorted(INDEX_CASES))
def test_arg_reductions_point_at_the_first_nan_as_in_eager(case):
    fn = INDEX_CASES[case]
    x, y = _with_specials(torch.float32), None
    with config.patch(fallback="error"):
        got = torch.compile(fn, backend="neuron")(x, y)
    assert torch.equal(got, fn(x, y))
