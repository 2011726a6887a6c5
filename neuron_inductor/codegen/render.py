"""Render kernel source from the Jinja templates in the top-level `codegen_templates/`.

Each kernel family has one template, `codegen_templates/<family>.py.j2`. A template sees:
- `kernel_name`: the function name to define;
- `inputs` / `outputs`: lists of `TensorArg` (name, shape, dtype as an `nl.` expression, ...);
- every key of the KernelSpec's `params`;
- `tile` and `target`: the `LoweringContext`'s tile sizes (`tile.partitions`, `tile.psum_fmax`,
  ...) and hardware target: templates write sizes from these, never as literal numbers;
- helpers: `nl_dtype(torch_dtype_name)`, `cdiv(a, b)`, `tiles(extent, size)`, `prod(seq)`, and `inf`
  (Jinja folds `"inf" | float` at compile time into an undefined name, so infinities come from here);
- the filter `literal`: every number a template writes from its params goes through it
  (`{{ value | literal }}`), so that +-inf / NaN come out as `float('-inf')`, not a bare name.
Shared macros live in `codegen_templates/_*.py.j2` files and are imported by family templates.
Rendering is strict (undefined names raise) and deterministic: the same spec renders
byte-identical source, which keys the kernel cache.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import jinja2
import torch
import torch.fx as fx

from ..lowering.context import LoweringContext
from ..lowering.ir import KernelSpec
from .kernel_args import kernel_shape

NL_DTYPES = {
    torch.float32: "nl.float32", torch.bfloat16: "nl.bfloat16", torch.float16: "nl.float16",
    torch.float8_e4m3fn: "nl.float8_e4m3", torch.float8_e5m2: "nl.float8_e5m2",
    torch.int8: "nl.int8", torch.int16: "nl.int16", torch.int32: "nl.int32", torch.uint8: "nl.uint8",
    torch.bool: "nl.uint8",
    # NKI has no 64-bit types: the host narrows int64 values to int32 before any kernel call (kernel_args).
    torch.int64: "nl.int32",
}


class TemplateError(RuntimeError):
    """A template failed to render, or rendered source that is not valid Python."""


def templates_dir() -> Path:
    """The templates shipped in the wheel, or the top-level folder of a source checkout."""
    installed = Path(__file__).resolve().parent.parent / "codegen_templates"
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parents[2] / "codegen_templates"


def nl_dtype(dtype: torch.dtype) -> str:
    try:
        return NL_DTYPES[dtype]
    except KeyError:
        raise TemplateError(f"dtype {dtype} has no NKI on-chip equivalent") from None


@dataclass(frozen=True)
class TensorArg:
    """A kernel argument or result as templates see it."""

    name: str
    shape: tuple[int, ...]
    torch_dtype: torch.dtype

    @property
    def dtype(self) -> str:
        """The on-chip NKI dtype expression, e.g. 'nl.bfloat16'."""
        return nl_dtype(self.torch_dtype)

    @property
    def hbm_dtype(self) -> str:
        """The dtype to allocate a kernel output with in HBM. NKI has no 64-bit integers: an int64
        graph value produced by a kernel is an int32 tensor (the host wrapper widens it where it
        leaves the kernels); a bool value is nl.bool_ in HBM (uint8 tiles on chip)."""
        return "nl.bool_" if self.torch_dtype == torch.bool else self.dtype

    @property
    def hbm_shape(self) -> tuple[int, ...]:
        """The shape to allocate a kernel output with in HBM: HBM tensors are at least 1-D, so a
        0-d value is a shape-[1] tensor (the host wrapper views it as 0-d)."""
        return kernel_shape(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def literal(value: bool | int | float) -> str:
    """Python source of a number param. repr() writes non-finite floats as bare `inf` / `nan`,
    undefined names in a kernel; `float('-inf')` is plain Python that real NKI evaluates at trace time."""
    if not isinstance(value, (bool, int, float)):
        raise TemplateError(f"{value!r} of type {type(value).__name__} is not a Python number")
    if isinstance(value, float) and not math.isfinite(value):
        return f"float('{value}')"
    return repr(value)


# Names that only appear in rendered source when a non-finite float skipped the `literal` filter.
_NON_FINITE_NAMES = frozenset({"inf", "nan"})


def tensor_arg(name: str, value: fx.Node | torch.Tensor) -> TensorArg:
    val = value.meta["val"] if isinstance(value, fx.Node) else value
    return TensorArg(name, tuple(int(s) for s in val.shape), val.dtype)


def _tiles(extent: int, size: int) -> list[tuple[int, int]]:
    """[(start, length), ...] covering range(extent) in tiles of at most `size`."""
    return [(start, min(size, extent - start)) for start in range(0, extent, size)]


@functools.lru_cache(maxsize=None)
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.globals.update(
        nl_dtype=nl_dtype,
        cdiv=lambda a, b: -(-a // b),
        tiles=_tiles,
        prod=math.prod,
        min=min,
        max=max,
        inf=math.inf,
    )
    env.filters["literal"] = literal
    return env


@functools.lru_cache(maxsize=None)
def template_hash(family: str) -> str:
    """Hash of a family's template and of the shared macro files it may import."""
    folder = templates_dir()
    digest = hashlib.sha256()
    for path in sorted([folder / f"{family}.py.j2", *folder.glob("_*.py.j2")]):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def all_template_hashes() -> dict[str, str]:
    return {p.name.removesuffix(".py.j2"): template_hash(p.name.removesuffix(".py.j2"))
            for p in sorted(templates_dir().glob("[!_]*.py.j2"))}


# Stands for the kernel's name in memoized sources: a model's repeated layers render the same
# kernels under other names, and rendering is deterministic, so each distinct kernel renders once.
_NAME = "__neuron_kernel__"
_rendered: dict[tuple, str] = {}


def render_template(family: str, kernel_name: str, inputs: list[TensorArg], outputs: list[TensorArg],
                    params: dict, ctx: LoweringContext) -> str:
    """Render one kernel for the target of `ctx` and check that the result is valid Python."""
    key = (environment(), family, ctx, tuple(inputs), tuple(outputs), repr(params))
    memoizable = " at 0x" not in key[-1]  # an object's default repr names its address, not its content
    source = _rendered.get(key) if memoizable else None
    if source is None:
        source = _render(family, kernel_name, inputs, outputs, params, ctx)
        if memoizable:
            _rendered[key] = source
    return source.replace(f"def {_NAME}(", f"def {kernel_name}(", 1)


def unnamed(source: str, kernel_name: str) -> str:
    """A kernel's source as it reads under any name (kernels equal up to their name compare equal)."""
    return source.replace(f"def {kernel_name}(", f"def {_NAME}(", 1)


def _render(family: str, kernel_name: str, inputs: list[TensorArg], outputs: list[TensorArg],
            params: dict, ctx: LoweringContext) -> str:
    """The source with the kernel named `_NAME` (`kernel_name` is for messages)."""
    try:
        template = environment().get_template(f"{family}.py.j2")
    except jinja2.TemplateNotFound:
        raise TemplateError(f"no template for kernel family {family!r} in {templates_dir()}") from None
    clash = {"kernel_name", "inputs", "outputs", "tile", "target"} & set(params)
    if clash:
        raise TemplateError(f"kernel params may not redefine {sorted(clash)}")
    try:
        source = template.render(kernel_name=_NAME, inputs=inputs, outputs=outputs, tile=ctx.tile,
                                 target=ctx.target, **params)
    except jinja2.TemplateError as exc:
        raise TemplateError(f"template {family}.py.j2 failed to render {kernel_name}: {exc}") from exc
    try:
        tree = ast.parse(source, filename=f"{kernel_name}.py")
    except SyntaxError as exc:
        raise TemplateError(f"template {family}.py.j2 rendered invalid Python for {kernel_name}: {exc}") from exc
    jitted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == _NAME]
    if jitted and not jitted[0].args.args:
        raise TemplateError(f"template {family}.py.j2 rendered {kernel_name} without arguments: nki.jit detects "
                            f"the framework from the kernel's tensor arguments, so every kernel takes one")
    bare = sorted({node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id in _NON_FINITE_NAMES})
    if bare:
        raise TemplateError(f"template {family}.py.j2 wrote a non-finite float as the bare name(s) {bare} for "
                            f"{kernel_name}: render numbers with the `literal` filter")
    return source


def render_kernel(spec: KernelSpec, ctx: LoweringContext) -> str:
    """Render a KernelSpec whose `name` is set, for the target it was lowered for (`ctx`); inputs
    are named in0.., outputs out0.."""
    inputs = [tensor_arg(f"in{i}", node) for i, node in enumerate(spec.inputs)]
    outputs = [tensor_arg(f"out{i}", value) for i, value in enumerate(spec.outputs)]
    return render_template(spec.family, spec.name, inputs, outputs, spec.params, ctx)
