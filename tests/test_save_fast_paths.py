"""The fast paths of the save side, checked against what they replace.

``flatten`` finds ties by address first and compares whole views only where several
tensors start at one address; ``codec.encode`` hands plain containers and exact tensors on
without the caller's hook and refuses trees nested too deep itself (``check_tree`` runs on
save only where a hook built part of the tree); the safetensors header is joined from
one string per piece and must be the bytes ``json.dumps`` writes for the same header.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import pytest
import torch
from safetensors.torch import load_file

import safeckpt
from safeckpt.format import codec
from safeckpt.format.codec import MAX_DEPTH
from safeckpt.format.tensors import SAFETENSORS_DTYPES
from safeckpt.protocol.datafile import plan_layout
from safeckpt.protocol.state import flatten


def test_ties_are_found_among_every_view_that_starts_at_one_address():
    base = torch.arange(24, dtype=torch.float32)
    matrix = base.view(4, 6)
    state = {"a_base": base, "b_head": base[:6], "c_matrix": matrix, "d_again": base.view(4, 6),
             "e_ints": base.view(torch.int32), "f_base_again": base.view(24), "g_t": matrix.t(),
             "h_t_again": base.view(4, 6).t(), "i_other": base[1:], "j_empty": base[:0], "k_empty": base[:0]}
    flat = flatten(state)
    assert flat.aliases == {"d_again": "c_matrix", "f_base_again": "a_base", "h_t_again": "g_t"}
    assert set(flat.pieces) == {"a_base", "b_head", "c_matrix", "e_ints", "g_t", "i_other", "j_empty", "k_empty"}
    assert flat.tree["d_again"] == {"$tensor": "d_again"}


def test_ties_keep_shards_and_kinds_apart(tmp_path):
    """A tensor saved whole and the same memory as a shard of a larger tensor are two pieces."""
    t = torch.arange(8, dtype=torch.float32)
    flat = flatten({"whole": t, "shard": safeckpt.Shard(t, global_shape=[16], offsets=[8]), "tied": t})
    assert flat.aliases == {"tied": "whole"} and set(flat.pieces) == {"whole", "shard"}
    assert flat.pieces["shard"].info.offsets == (8,) and flat.pieces["shard"].info.global_shape == (16,)


def test_tied_views_round_trip_through_save_and_load(tmp_path):
    base = torch.randn(6, 4)
    state = {"w": base, "w_view": base.view(6, 4), "cols": base[:, 1], "cols2": base[:, 1],
             "p": torch.nn.Parameter(base), "list": [base.t(), base.t()], "tup": (base[2], base[2])}
    safeckpt.save(state, tmp_path / "c")
    got = safeckpt.load_state(tmp_path / "c")
    assert got["w"] is got["w_view"] and got["cols"] is got["cols2"] and got["list"][0] is got["list"][1]
    assert torch.equal(got["cols"], base[:, 1]) and torch.equal(got["list"][0], base.t())
    assert torch.equal(got["tup"][1], base[2]) and torch.equal(got["p"], base)


def _encode(value):
    return codec.encode(value, "", lambda k, t: {"$tensor": k}, lambda k, v: v, False)


def test_encode_names_tensors_in_every_container_as_before():
    t = torch.zeros(1)
    p = torch.nn.Parameter(torch.zeros(1))
    tree = _encode({"a": {"b": t, "c": [t, (p, 3)]}, 5: t, "$x": OrderedDict(y=t), "s": torch.Size([2, 3])})
    assert tree == {"$dict": [
        ["a", {"b": {"$tensor": "a.b"}, "c": [{"$tensor": "a.c.0"}, {"$tuple": [{"$tensor": "a.c.1.0"}, 3]}]}],
        [5, {"$tensor": "5"}],
        ["$x", {"$odict": [["y", {"$tensor": "$x.y"}]]}],
        ["s", {"$size": [2, 3]}]]}
    codec.check_tree(tree, "test", {"a.b", "a.c.0", "a.c.1.0", "5", "$x.y"})  # what load checks accepts it


def test_encode_gives_the_hook_every_value_that_is_not_plain():
    class Sub(torch.Tensor):
        pass

    seen = []
    sub = torch.zeros(2).as_subclass(Sub)
    codec.encode({"od": OrderedDict(a=1), "sub": sub, "t": torch.zeros(1), "n": 3}, "",
                 lambda k, t: {"$tensor": k}, lambda k, v: seen.append(k) or v, False)
    assert seen == ["od", "sub"]  # plain dicts, exact tensors and leaves skip the hook


def _nest_lists(depth: int, leaf):
    node = leaf
    for _ in range(depth):
        node = [node]
    return node


@pytest.mark.parametrize("leaf", [1, "x", torch.zeros(1)])
def test_the_depth_limit_is_the_one_load_enforces(tmp_path, leaf):
    """Containers (and tensor references) at depth MAX_DEPTH are refused on save, leaves
    there are not: exactly what ``check_tree`` accepts on load."""
    ok = {"x": _nest_lists(MAX_DEPTH - 1 - isinstance(leaf, torch.Tensor), leaf)}
    safeckpt.save(ok, tmp_path / "ok")
    assert safeckpt.verify(tmp_path / "ok").ok
    safeckpt.load_state(tmp_path / "ok")
    with pytest.raises(safeckpt.UnsafeObjectError, match="nested more than"):
        safeckpt.save({"x": _nest_lists(MAX_DEPTH - isinstance(leaf, torch.Tensor), leaf)}, tmp_path / "deep")
    assert not (tmp_path / "deep").exists() or not list((tmp_path / "deep").iterdir())


def test_a_state_that_contains_itself_is_refused_cleanly(tmp_path):
    state: dict = {"w": torch.zeros(2)}
    state["me"] = state
    with pytest.raises(safeckpt.UnsafeObjectError, match="nested more than"):
        safeckpt.save(state, tmp_path / "c")


def test_metadata_nested_too_deep_is_refused_on_save_not_on_load(tmp_path):
    deep: dict = {}
    node = deep
    for _ in range(MAX_DEPTH + 5):
        node["a"] = node = {}
    with pytest.raises(safeckpt.UnsafeObjectError, match="nested more than"):
        safeckpt.save({"w": torch.zeros(1)}, tmp_path / "c", metadata={"deep": deep})


def test_rank_local_subtrees_are_still_checked(tmp_path):
    """A RankLocal hook encodes its subtree from depth 0: the whole tree is checked."""
    with pytest.raises(safeckpt.UnsafeObjectError, match="nested more than"):
        safeckpt.save({"x": _nest_lists(MAX_DEPTH - 3, safeckpt.RankLocal(_nest_lists(5, 1)))}, tmp_path / "c")
    safeckpt.save({"x": safeckpt.RankLocal({"t": torch.ones(2), "n": 1})}, tmp_path / "ok")
    assert safeckpt.load_state(tmp_path / "ok")["x"][0]["n"] == 1


def _header_by_json(pieces, metadata) -> bytes:
    """The header as the dict + ``json.dumps`` code this replaced wrote it."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in pieces:
        code = SAFETENSORS_DTYPES.get(t.dtype)
        header["_" + name if name == "__metadata__" else name] = {
            "dtype": code or "U8", "shape": list(t.shape) if code else [t.nbytes],
            "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def test_the_header_is_the_text_json_writes():
    pieces = [("a", torch.zeros(3, 4)), ("__metadata__", torch.zeros(2)), ('q"uo\\te\n', torch.zeros(0)),
              ("ünï名", torch.tensor(1.5)), ("c128", torch.zeros(2, 3, dtype=torch.complex128)),
              ("mask", torch.zeros(5, dtype=torch.bool)), ("strided", torch.zeros(4, 5).t()),
              ("bf16", torch.zeros(0, 3, dtype=torch.bfloat16)), ("f8", torch.zeros(7, dtype=torch.float8_e5m2))]
    metadata = {"format": "pt", "safeckpt_save_id": 'a"b'}
    layout = plan_layout(pieces, metadata)
    assert layout.header[8:] == _header_by_json(pieces, metadata)
    assert [e[2:] for e in layout.entries][:3] == [(len(layout.header), len(layout.header) + 48),
                                                   (len(layout.header) + 48, len(layout.header) + 56),
                                                   (len(layout.header) + 56, len(layout.header) + 56)]


def test_files_with_awkward_names_stay_safetensors_files(tmp_path):
    state = {"__metadata__": torch.arange(3.0), 'q"uo\\te': torch.ones(2), "ünï名": torch.zeros(2, 2),
             "c": torch.zeros(2, dtype=torch.complex128)}
    safeckpt.save(state, tmp_path / "c")
    (data,) = (tmp_path / "c").glob("data-*.safetensors")
    plain = load_file(str(data))
    assert torch.equal(plain["___metadata__"], state["__metadata__"]) and torch.equal(plain["ünï名"], state["ünï名"])
    assert plain["c"].dtype == torch.uint8 and plain["c"].numel() == 32
    got = safeckpt.load_state(tmp_path / "c")
    assert all(torch.equal(got[k], v) for k, v in state.items())
