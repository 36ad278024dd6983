"""Every KV layout vLLM can hand ``register_kv_caches``, through ``kv_regions``.

The per-layer views are built by vLLM's own ``create_kv_cache_views`` (the
code the model runner uses) on a CPU int8 buffer, for every ``KVCacheLayout``
x {full attention with 1 and 8 KV heads, MLA, FP8} x block sizes 16/64/128,
plus padded pages and kernel-block splits. For an accepted case, known bytes
written into one block of one layer through vLLM's view must be exactly the
bytes the connector's region names for that block (nothing of a neighbouring
block or layer); a refused case must say why. The table is
docs/architecture.md#kv-layouts.
"""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch
from vllm.config import CacheConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
    create_kv_cache_views,
)

from vllm_pd_ext import compat
from vllm_pd_ext.compat.layout import dense_problem, kv_layout_name, normalize_dtype
from vllm_pd_ext.connector import PDConnector
from vllm_pd_ext.wire.protocol import CompatInfo, Region

NUM_LAYERS = 3
NUM_BLOCKS = 5
#: Layer and block the known bytes go to (a middle one: both have neighbours).
LAYER, BLOCK = 1, 2
#: Layouts whose blocks are dense for any number of head slots.
BLOCK_INNER = {"LBHNC", "LBNHC", "BLHNC", "BLNHC"}


def make_spec(kind: str, block_size: int, padded: int = 0) -> FullAttentionSpec:
    extra = {"page_size_padded": padded} if padded else {}
    if kind == "mla":
        return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=72,
                                dtype=torch.bfloat16, **extra)
    heads = {"full1": 1, "full8": 8, "fp8": 8}[kind]
    dtype = torch.float8_e4m3fn if kind == "fp8" else torch.bfloat16
    return FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=16,
                             dtype=dtype, **extra)


def build(layout: KVCacheLayout, spec: FullAttentionSpec, kernel_block_size: int | None = None
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vLLM's allocation for one group of NUM_LAYERS same-shaped layers
    (as ``kv_cache_utils.get_kv_cache_config_from_groups`` places it)."""
    page = spec.page_size_bytes
    if layout.is_block_outermost:
        fixed_block_stride: int | None = NUM_LAYERS * page
    elif spec.page_size_padded is not None:
        fixed_block_stride = page
    else:
        fixed_block_stride = None
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, NUM_BLOCKS, NUM_LAYERS, layout,
        fixed_strides=(None, fixed_block_stride, None, None, None))
    size = NUM_LAYERS * NUM_BLOCKS * page
    raw = torch.zeros(size, dtype=torch.int8)
    names = [f"layers.{i}.attn" for i in range(NUM_LAYERS)]
    tensor = KVCacheTensor(size=size, layers=names, layer_stride=layer_stride,
                           block_stride=block_stride)
    views = create_kv_cache_views(raw, spec, NUM_BLOCKS, layout, tensor, kernel_block_size)
    return raw, dict(zip(names, views, strict=True))


def assert_regions_cover_the_block(raw: torch.Tensor, views: dict[str, torch.Tensor],
                                   regions: list[Region]) -> None:
    assert len(regions) == NUM_LAYERS
    view = next(v for i, v in enumerate(views.values()) if i == LAYER)
    ratio = view.shape[0] // NUM_BLOCKS
    # Known non-zero bytes into every kernel block of manager block BLOCK, through
    # vLLM's own (strided, dtype-typed) view; C is innermost, so a byte view works.
    part = view[BLOCK * ratio:(BLOCK + 1) * ratio].view(torch.uint8)
    gen = torch.Generator().manual_seed(25)
    part.copy_(torch.randint(1, 256, part.shape, dtype=torch.uint8, generator=gen))

    region = regions[LAYER]
    start = region.base_addr - raw.data_ptr() + BLOCK * region.block_stride
    written = torch.nonzero(raw).flatten()
    assert written.numel() == region.block_len == view[0].numel() * view.element_size() * ratio
    assert written.tolist() == list(range(start, start + region.block_len))

    # Every (layer, block) range lies in the buffer, and none overlaps another.
    spans = sorted(
        (r.base_addr - raw.data_ptr() + b * r.block_stride, r.block_len)
        for r in regions for b in range(r.num_blocks))
    assert spans[0][0] >= 0 and spans[-1][0] + spans[-1][1] <= raw.numel()
    for (a, n), (b, _) in itertools.pairwise(spans):
        assert a + n <= b, "two blocks' regions overlap"


# -------------------------------------------------------------------- matrix
@pytest.mark.parametrize("block_size", [16, 64, 128])
@pytest.mark.parametrize("kind", ["full1", "full8", "mla", "fp8"])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
def test_every_layout_and_kind(layout, kind, block_size):
    spec = make_spec(kind, block_size)
    raw, views = build(layout, spec)
    if layout.name in BLOCK_INNER or spec.num_heads == 1:
        regions = compat.kv_regions(views, NUM_BLOCKS)
        assert_regions_cover_the_block(raw, views, regions)
        page = spec.page_size_bytes
        stride = NUM_LAYERS * page if layout.is_block_outermost else page
        assert {(r.block_stride, r.block_len) for r in regions} == {(stride, page)}
    else:
        with pytest.raises(RuntimeError, match="not one dense range") as err:
            compat.kv_regions(views, NUM_BLOCKS)
        assert "padded" not in str(err.value)


@pytest.mark.parametrize("kind", ["full1", "full8", "mla"])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
def test_padded_pages(layout, kind):
    spec = make_spec(kind, 16)
    spec = make_spec(kind, 16, padded=spec.page_size_bytes + 256)
    try:
        raw, views = build(layout, spec)
    except AssertionError:
        # vLLM pads pages only where the page is the tail of the layout.
        assert not (layout.name in BLOCK_INNER or spec.num_heads == 1)
        return
    regions = compat.kv_regions(views, NUM_BLOCKS)
    assert_regions_cover_the_block(raw, views, regions)
    assert all(r.block_stride > r.block_len for r in regions)


@pytest.mark.parametrize("kind", ["full1", "full8", "mla", "fp8"])
@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda m: m.name)
def test_kernel_block_split(layout, kind):
    """Manager block 64 split into kernel blocks of 16: the view has
    4 * num_blocks kernel blocks; a manager block is 4 abutting ones."""
    spec = make_spec(kind, 64)
    try:
        raw, views = build(layout, spec, kernel_block_size=16)
    except ValueError as exc:  # vLLM itself refuses splits of non-dense pages
        assert "kernel block" in str(exc)
        assert layout.is_block_outermost or not layout.is_block_contiguous
        return
    assert next(iter(views.values())).shape[0] == 4 * NUM_BLOCKS
    assert compat.kernel_blocks_per_block(views, NUM_BLOCKS) == 4  # told to peers
    if layout.name in BLOCK_INNER or spec.num_heads == 1:
        assert_regions_cover_the_block(raw, views, compat.kv_regions(views, NUM_BLOCKS))
    else:
        with pytest.raises(RuntimeError, match="not one dense range"):
            compat.kv_regions(views, NUM_BLOCKS)


# ------------------------------------------------------------ other shapes
def test_legacy_kv_split_form_gives_k_and_v_regions():
    t = torch.zeros(2, NUM_BLOCKS, 16, 2, 8, dtype=torch.bfloat16)  # [2, B, N, H, D]
    regions = compat.kv_regions({"l0": t}, NUM_BLOCKS)
    assert compat.kernel_blocks_per_block({"l0": t}, NUM_BLOCKS) == 1
    block = 16 * 2 * 8 * 2
    assert [(r.base_addr, r.block_stride, r.block_len, r.num_blocks) for r in regions] == [
        (t.data_ptr(), block, block, NUM_BLOCKS),
        (t.data_ptr() + NUM_BLOCKS * block, block, block, NUM_BLOCKS)]


def test_kernel_blocks_that_do_not_abut_are_refused_by_cause():
    # 4 kernel blocks per block, each dense, but padded apart.
    t = torch.zeros(4 * NUM_BLOCKS * 128, dtype=torch.int8).as_strided(
        (4 * NUM_BLOCKS, 1, 16, 4), (128, 64, 4, 1))
    with pytest.raises(RuntimeError, match="kernel blocks per block whose stride"):
        compat.kv_regions({"l0": t}, NUM_BLOCKS)


def test_no_block_dimension_is_refused_by_cause():
    with pytest.raises(RuntimeError, match="no block dimension of 5"):
        compat.kv_regions({"l0": torch.zeros(7, 2, 16, 8)}, NUM_BLOCKS)


def test_dense_problem():
    assert dense_problem((2, 16, 8), (128, 8, 1)) == ""
    assert dense_problem((2, 16, 8), (8, 16, 1)) == ""  # permuted, still dense
    assert dense_problem((1, 16, 8), (999, 8, 1)) == ""  # size-1 dims do not count
    assert "gaps" in dense_problem((2, 16, 8), (256, 8, 1))


# ------------------------------------------------------ what vLLM is told
def test_required_layout_is_lbhnc_except_mla():
    class Cfg:
        model_config = type("M", (), {"use_mla": False})()

    assert PDConnector.get_required_kvcache_layout(Cfg()) == "LBHNC"
    Cfg.model_config.use_mla = True
    assert PDConnector.get_required_kvcache_layout(Cfg()) is None


def test_handshake_carries_the_resolved_layout():
    class Cfg:
        cache_config = CacheConfig()

    assert kv_layout_name(Cfg()) == "unresolved"
    Cfg.cache_config.kv_cache_layout = "NHD"  # vLLM's legacy alias
    assert kv_layout_name(Cfg()) == "LBNHC"
    Cfg.cache_config.kv_cache_layout = "BLHNC"
    assert kv_layout_name(Cfg()) == "BLHNC"


@pytest.mark.parametrize(("a", "b"), [("fp8", "fp8_e4m3"), ("torch.float16", "half"),
                                      ("bfloat16", "torch.bfloat16")])
def test_cache_dtype_aliases_are_one_name(a, b):
    assert normalize_dtype(a) == normalize_dtype(b)
    assert normalize_dtype("fp8_e5m2") != normalize_dtype("fp8")


def test_cpu_and_gpu_engines_are_refused_by_device():
    base = CompatInfo(protocol_version=5, model="m", dtype="bfloat16", block_size=16,
                      kv_layout="LBHNC", num_layers=2, num_kv_heads=2, head_size=64,
                      tp_size=1, transfer_mode="pull", device="cpu", attn_backend="auto")
    gpu = msgspec.structs.replace(base, device="cuda", attn_backend="FLASH_ATTN")
    assert base.diff(gpu) == ["device: ours='cpu' theirs='cuda'"]
    # A peer that predates the field is not refused for it.
    assert base.diff(msgspec.structs.replace(base, device="")) == []


def test_peers_with_another_kernel_block_split_are_refused_by_name():
    """Same block length, other byte order: LBHNC with 8 heads, block 64,
    split into 4 kernel blocks on one side only."""
    from vllm_pd_ext.wire import protocol as proto
    from vllm_pd_ext.worker.peers import layout_problem

    regions = [proto.Region(0x1000, 4096, 4096, NUM_BLOCKS)]

    def agent(kernel_blocks: int) -> proto.AgentInfo:
        return proto.AgentInfo(tp_rank=0, agent_name="a", agent_metadata=b"", mem_type="DRAM",
                               kernel_blocks=kernel_blocks, regions=regions)

    assert layout_problem(agent(4), regions, kernel_blocks=4) == ""
    problem = layout_problem(agent(4), regions, kernel_blocks=1)
    assert "splits each KV block into 4 kernel block(s) and we into 1" in problem
    # A peer from before the field: decoded with 1, as it never split.
    old = proto.AgentInfo(tp_rank=0, agent_name="a", agent_metadata=b"", mem_type="DRAM",
                          regions=regions)
    assert old.kernel_blocks == 1 and layout_problem(old, regions) == ""
