"""The NkiTensor view methods of NKI 0.4+: permute, broadcast, expand_dim, squeeze_dim, reshape_dim,
flatten_dims, slice, select, vector_select, rearrange and the layout queries. Each returns a new view of the same
storage (no copy); on-chip tensors keep dim 0 as the partition dim, so no method may move or
remove it. Dynamic `select(dim, tile)` is a scalar-indirect view of an HBM tensor (indirect.py)."""

from __future__ import annotations

import operator

from .errors import NkiError, NkiIndexError


class ViewMethods:
    """Mixed into NkiTensor (which supplies data, dtype, buffer, alloc, name)."""

    __slots__ = ()

    def _view(self, data):
        from .tensor import NkiTensor  # tensor.py mixes this class in

        return NkiTensor(data, self.dtype, self.buffer, self.alloc, self.name)

    def _dim(self, api, dim, allow_partition=False):
        ndim = self.data.dim()
        dim = operator.index(dim)
        if dim < 0:
            dim += ndim
        if not 0 <= dim < ndim:
            raise NkiIndexError(f"NkiTensor.{api}: dim {dim} is not a dim of the {ndim}-d tensor")
        if dim == 0 and self.buffer.on_chip and not allow_partition:
            raise NkiError(f"NkiTensor.{api}: dim 0 of an on-chip tensor is the partition dim")
        return dim

    # ------------------------------------------------------------------ layout queries

    @property
    def strides(self) -> tuple:
        return tuple(self.data.stride())

    @property
    def offset(self) -> int:
        return self.data.storage_offset() - self.alloc.storage.storage_offset()

    @property
    def size(self) -> int:
        return self.data.numel()

    def is_contiguous(self) -> bool:
        """Row-major over the free dims (on-chip, the partition stride does not count)."""
        data = self.data
        expected = 1
        for dim in range(data.dim() - 1, 0 if self.buffer.on_chip else -1, -1):
            if data.shape[dim] != 1 and data.stride(dim) != expected:
                return False
            expected *= data.shape[dim]
        return True

    def get_pattern(self) -> list:
        return [[stride, size] for stride, size in zip(self.data.stride(), self.data.shape)]

    def is_indirect(self) -> bool:
        return False

    # ------------------------------------------------------------------ views

    def permute(self, dims) -> "ViewMethods":
        dims = tuple(operator.index(d) for d in dims)
        if sorted(dims) != list(range(self.data.dim())):
            raise NkiError(f"NkiTensor.permute: {dims} is not a permutation of the {self.data.dim()} dims")
        if self.buffer.on_chip and dims[0] != 0:
            raise NkiError("NkiTensor.permute: on-chip tensors keep the partition dim first (dims[0] == 0)")
        return self._view(self.data.permute(dims))

    def broadcast(self, dim, size) -> "ViewMethods":
        dim = self._dim("broadcast", dim)
        if self.data.shape[dim] != 1:
            raise NkiError(f"NkiTensor.broadcast: dim {dim} has size {self.data.shape[dim]}, not 1")
        shape = list(self.data.shape)
        shape[dim] = operator.index(size)
        return self._view(self.data.expand(shape))

    def expand_dim(self, dim) -> "ViewMethods":
        dim = operator.index(dim)
        if dim < 0:
            dim += self.data.dim() + 1
        if not 0 <= dim <= self.data.dim() or (dim == 0 and self.buffer.on_chip):
            raise NkiError(f"NkiTensor.expand_dim: cannot insert a dim at {dim}")
        return self._view(self.data.unsqueeze(dim))

    def squeeze_dim(self, dim) -> "ViewMethods":
        dim = self._dim("squeeze_dim", dim)
        if self.data.shape[dim] != 1:
            raise NkiError(f"NkiTensor.squeeze_dim: dim {dim} has size {self.data.shape[dim]}, not 1")
        return self._view(self.data.squeeze(dim))

    def reshape_dim(self, dim, shape) -> "ViewMethods":
        dim = self._dim("reshape_dim", dim, allow_partition=len(tuple(shape)) == 1)
        sizes = [operator.index(s) for s in shape]
        known = 1
        for s in sizes:
            known *= s if s != -1 else 1
        if sizes.count(-1) == 1:
            sizes[sizes.index(-1)] = self.data.shape[dim] // known
        product = 1
        for s in sizes:
            product *= s
        if product != self.data.shape[dim]:
            raise NkiError(f"NkiTensor.reshape_dim: {tuple(sizes)} does not split a dim of size {self.data.shape[dim]}")
        data = self.data
        return self._view(data.unflatten(dim, sizes))

    def flatten_dims(self, start_dim, end_dim) -> "ViewMethods":
        start = self._dim("flatten_dims", start_dim)
        end = self._dim("flatten_dims", end_dim)
        shape = list(self.data.shape)
        try:
            return self._view(self.data.view(shape[:start] + [_product(shape[start:end + 1])] + shape[end + 1:]))
        except RuntimeError:
            raise NkiError(f"NkiTensor.flatten_dims: dims {start}..{end} are not contiguous in memory") from None

    def slice(self, dim, start, end, step=1) -> "ViewMethods":
        dim = self._dim("slice", dim, allow_partition=True)
        key = [slice(None)] * self.data.dim()
        key[dim] = slice(operator.index(start), operator.index(end), operator.index(step))
        return self[tuple(key)]

    def select(self, dim, index) -> "ViewMethods":
        if getattr(index, "buffer", None) is not None or type(index).__name__ == "VirtualRegister":
            return self._dynamic_select(dim, index)
        dim = self._dim("select", dim)
        key = [slice(None)] * self.data.dim()
        key[dim] = operator.index(index)
        return self[tuple(key)]

    def _dynamic_select(self, dim, index):
        if self.buffer.on_chip:
            raise NkiError("NkiTensor.select: a dynamic (tile / register) index selects from HBM tensors only")
        dim = self._dim("select", dim)
        data = self.data
        pattern = [[data.stride(d), data.shape[d]] for d in range(data.dim()) if d != dim]
        return self.ap(pattern, offset=0, scalar_offset=index, indirect_dim=dim)

    def vector_select(self, dim, vector_offset) -> "ViewMethods":
        """Row vector_offset[p] of dim 0 for each partition p: shape (P, *shape[1:]) (HBM gathers / scatters)."""
        if operator.index(dim) != 0 or self.buffer.on_chip:
            raise NkiError("NkiTensor.vector_select: dim must be 0 and the tensor in HBM")
        data = self.data
        rows = vector_offset.data.shape[0]
        pattern = [[data.stride(0), rows]] + [[data.stride(d), data.shape[d]] for d in range(1, data.dim())]
        return self.ap(pattern, offset=0, vector_offset=vector_offset, indirect_dim=0)

    def rearrange(self, src_pattern, dst_pattern, fixed_sizes=None) -> "ViewMethods":
        """einops-style: split grouped source dims, reorder, merge grouped destination dims."""
        fixed = dict(fixed_sizes or {})
        if len(src_pattern) != self.data.dim():
            raise NkiError(f"NkiTensor.rearrange: {src_pattern} names {len(src_pattern)} dims of a "
                           f"{self.data.dim()}-d tensor")
        sizes = {}
        names = []
        for group, size in zip(src_pattern, self.data.shape):
            group = (group,) if isinstance(group, str) else tuple(group)
            unknown = [n for n in group if n not in fixed]
            if len(unknown) > 1:
                raise NkiError(f"NkiTensor.rearrange: group {group} needs sizes for all but one name")
            known = _product([fixed[n] for n in group if n in fixed])
            for n in group:
                sizes[n] = fixed[n] if n in fixed else size // known
            if _product([sizes[n] for n in group]) != size:
                raise NkiError(f"NkiTensor.rearrange: group {group} does not split a dim of size {size}")
            names.extend(group)
        data = self.data.reshape([sizes[n] for n in names]) if len(names) != len(src_pattern) else self.data
        flat_dst = [n for g in dst_pattern for n in ((g,) if isinstance(g, str) else tuple(g))]
        if sorted(flat_dst) != sorted(names):
            raise NkiError(f"NkiTensor.rearrange: {dst_pattern} must name exactly the dims of {src_pattern}")
        order = [names.index(n) for n in flat_dst]
        if self.buffer.on_chip and order[0] != 0:
            raise NkiError("NkiTensor.rearrange: on-chip tensors keep the partition dim first")
        data = data.permute(order)
        merged = [_product([sizes[n] for n in ((g,) if isinstance(g, str) else tuple(g))]) for g in dst_pattern]
        try:
            view = data.view(merged)
        except RuntimeError:
            raise NkiError(f"NkiTensor.rearrange: {dst_pattern} merges dims that are not contiguous in memory") from None
        return self._view(view)


def _product(values) -> int:
    total = 1
    for v in values:
        total *= v
    return total
