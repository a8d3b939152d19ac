"""Schema validation (data.md section 1): every rule has its own failing case with a message check, and the
demo and online schemas compile to the documented widths."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcvr_lib.schema import (
    DEFAULT_MAX_LEN,
    MAX_VOCAB,
    SchemaError,
    load_schema,
    parse_max_lens,
    parse_schema,
    schema_differences,
)

VALID = {
    "format": "raw_parquet",
    "user_int": [[1, 10, 1], [2, 5, 3]],
    "item_int": [[1, 7, 1]],  # the same fid in user_int and item_int is allowed
    "user_dense": [[2, 3]],
    "seq": {"seq_a": {"prefix": "pa", "ts_fid": 9, "features": [[8, 50], [9, 0]]}},
}


def broken(path: str, value, base: dict | None = None):
    """VALID (or `base`) with the item at `path` (dot/index path) replaced; value DELETE removes it."""
    raw = copy.deepcopy(VALID if base is None else base)
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = raw
    for key in parents:
        node = node[key]
    if value is DELETE:
        del node[last]
    elif isinstance(node, list) and last == len(node):
        node.append(value)
    else:
        node[last] = value
    return raw


DELETE = object()


def test_valid_schema_loads_with_layout():
    schema = load_schema(VALID)
    assert schema.item_dense == ()  # optional group, default empty
    assert [(f.fid, f.offset, f.dim) for f in schema.user_int] == [(1, 0, 1), (2, 1, 3)]
    assert schema.int_width("user") == 4 and schema.dense_width("user") == 3
    assert schema.int_vocab("user").tolist() == [10, 5, 5, 5]
    domain = schema.domain("seq_a")
    assert [f.fid for f in domain.side_features] == [8] and domain.ts_feature.fid == 9
    assert domain.max_len == 256 and domain.side_features[0].column == "pa_8"


def test_dict_entries_are_accepted():
    raw = broken("user_int.0", {"fid": 1, "vocab_size": 10, "dim": 1})
    raw["user_dense"] = [{"fid": 2, "dim": 3}]
    raw["seq"]["seq_a"]["features"][0] = {"fid": 8, "vocab_size": 50}
    assert load_schema(raw).user_int[0].vocab_size == 10


@pytest.mark.parametrize(
    "path,value,message",
    [
        ("format", "parquet", "schema format must be 'raw_parquet'"),
        ("format", DELETE, r"schema: missing key\(s\) \['format'\]"),
        ("user_dense", DELETE, r"schema: missing key\(s\) \['user_dense'\]"),
        ("seq", DELETE, r"schema: missing key\(s\) \['seq'\]"),
        ("extra", [], r"schema: unknown key\(s\) \['extra'\]"),
        ("user_int", [], "user_int: must list at least one feature"),
        ("item_int", [], "item_int: must list at least one feature"),
        ("user_int.1", [1, 4, 1], "user_int: duplicate fid 1"),
        ("user_dense.1", [2, 4], "user_dense: duplicate fid 2"),
        ("user_int.0", [1, 10, 0], "user_int fid 1: dim must be an integer >= 1"),
        ("item_int.0", [1, 7, -2], "item_int fid 1: dim must be an integer >= 1"),
        ("user_dense.0", [2, 0], "user_dense fid 2: dim must be an integer >= 1"),
        ("user_int.0", [1, -1, 1], "user_int fid 1: vocab_size must be an integer >= 0"),
        ("seq.seq_a.features.0", [8, -5], r"seq.seq_a.features fid 8: vocab_size must be an integer >= 0"),
        ("user_int.0", [1, 10], r"user_int\[0\]: expected \[fid, vocab_size, dim\]"),
        ("user_int.0", {"fid": 1, "vocab_size": 3, "dim": 1, "x": 1}, r"user_int\[0\]: unknown key\(s\) \['x'\]"),
        ("user_int.0", {"fid": 1, "dim": 1}, r"user_int\[0\]: missing key\(s\) \['vocab_size'\]"),
        ("user_int.0", [-1, 10, 1], r"user_int\[0\]: fid must be an integer >= 0"),
        ("user_int", {"a": 1}, "user_int: expected a list of feature entries"),
        ("seq.seq_a.prefix", "", "seq.seq_a: prefix must be a non-empty string"),
        ("seq.seq_a.features", [], "seq.seq_a: must list at least one feature"),
        ("seq.seq_a.features.1", [8, 3], "seq.seq_a.features: duplicate fid 8"),
        ("seq.seq_a.ts_fid", 7, "seq.seq_a: ts_fid 7 is not one of the domain's feature fids"),
        ("seq.seq_a.extra", 1, r"seq.seq_a: unknown key\(s\) \['extra'\]"),
        ("seq.seq_a.ts_fid", DELETE, r"seq.seq_a: missing key\(s\) \['ts_fid'\]"),
        ("seq.seq_a", [1], "seq.seq_a: expected an object"),
        ("seq", [], "seq: expected an object mapping domain names"),
    ],
)
def test_each_rule_rejects_with_a_clear_message(path, value, message):
    with pytest.raises(SchemaError, match=message):
        load_schema(broken(path, value))


def test_empty_domain_name_rejected():
    raw = copy.deepcopy(VALID)
    raw["seq"] = {"": raw["seq"]["seq_a"]}
    with pytest.raises(SchemaError, match="seq: domain names must be non-empty strings"):
        load_schema(raw)


def test_duplicate_prefix_rejected():
    raw = copy.deepcopy(VALID)
    raw["seq"]["seq_b"] = copy.deepcopy(raw["seq"]["seq_a"])
    with pytest.raises(SchemaError, match="seq.seq_b: prefix 'pa' is already used by domain 'seq_a'"):
        load_schema(raw)


def test_schema_not_an_object_rejected():
    with pytest.raises(SchemaError, match="schema must be a JSON object"):
        parse_schema([])


def test_file_errors(tmp_path):
    with pytest.raises(SchemaError, match="schema file not found"):
        load_schema(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SchemaError, match="not valid JSON"):
        load_schema(bad)
    broken_file = tmp_path / "broken.json"
    broken_file.write_text(json.dumps(broken("user_int", [])))
    with pytest.raises(SchemaError, match="broken.json: user_int: must list at least one feature"):
        load_schema(broken_file)


def test_max_lens():
    assert parse_max_lens("seq_a:128, seq_b:64") == {"seq_a": 128, "seq_b": 64}
    with pytest.raises(SchemaError, match="expected DOMAIN:LENGTH"):
        parse_max_lens("seq_a=128")
    with pytest.raises(SchemaError, match="max_len of domain 'seq_a' must be an integer >= 1"):
        parse_max_lens({"seq_a": 0})
    schema = load_schema(VALID, max_lens="seq_a:7")
    assert schema.domain("seq_a").max_len == 7
    assert schema.with_max_lens({}).domain("seq_a").max_len == DEFAULT_MAX_LEN
    # a name the schema does not have is a typo: an error listing the schema's domains, never ignored
    with pytest.raises(SchemaError, match=r"unknown sequence domain\(s\) \['other'\]; this schema's domains: seq_a"):
        schema.with_max_lens({"other": 3})
    with pytest.raises(SchemaError, match=r"unknown sequence domain\(s\) \['seq_z'\]"):
        load_schema(VALID, max_lens="seq_a:7,seq_z:8")


def test_demo_schema_widths(repo_root):
    schema = load_schema(repo_root / "fixtures/sample_1000_raw.schema.json")
    assert len(schema.user_int) == 46 and len(schema.item_int) == 14 and len(schema.user_dense) == 10
    assert schema.int_width("user") == 234
    assert schema.int_width("item") == 33
    assert schema.dense_width("user") == 755
    assert schema.dense_width("item") == 0
    assert int(schema.int_vocab("item").max()) == 35_260
    assert [d.name for d in schema.domains] == ["seq_a", "seq_b", "seq_c", "seq_d"]
    assert [d.max_len for d in schema.domains] == [256, 256, 512, 512]
    assert [len(d.side_features) for d in schema.domains] == [8, 13, 11, 9]
    assert [d.ts_fid for d in schema.domains] == [39, 67, 27, 26]
    assert max(int(d.side_vocab.max()) for d in schema.domains) == 278_677_640
    assert len(schema.feature_columns) == 46 + 14 + 10 + 45


def test_online_schema_widths(repo_root):
    schema = load_schema(repo_root / "fixtures/online.schema.json")
    assert schema.int_width("user") == 411
    assert schema.dense_width("user") == 918


# ------------------------------------------------------------------ the id limit, folders, differences
@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=2**80), st.sampled_from(["user_int.0", "seq.seq_a.features.0"]))
def test_vocab_limit_is_the_int32_ids_of_a_batch(vocab, where):
    """Any vocab_size up to 2**31 - 1 (the largest int32 id a converted batch holds, what train accepts)
    parses; anything above (2**31, 2**63 - 1, 10**30) is refused naming the fid and the limit."""
    raw = broken(where, [1, vocab, 1] if where.startswith("user_int") else [8, vocab])
    if vocab <= MAX_VOCAB:
        assert parse_schema(raw)
    else:
        with pytest.raises(SchemaError, match=rf"fid \d+: vocab_size {vocab} is over 2,147,483,647 \(2\*\*31 - 1"):
            parse_schema(raw)


def test_timestamp_feature_vocab_is_not_limited():
    raw = broken("seq.seq_a.features.1", [9, 10**30])  # ts_fid 9: its values are times, its vocab unread
    assert parse_schema(raw).domain("seq_a").ts_feature.vocab_size == 10**30


def test_schema_path_that_is_a_folder(tmp_path):
    with pytest.raises(SchemaError, match=f"schema path {tmp_path} is a folder, not a schema JSON file$"):
        load_schema(tmp_path)
    (tmp_path / "schema.json").write_text(json.dumps(VALID))
    with pytest.raises(SchemaError, match=f"is a folder, not a schema JSON file; did you mean {tmp_path}/schema.json"):
        load_schema(tmp_path)


def _mutations():
    """One change of the schema's layout each: (dotted path, new value, the phrase schema_differences names)."""
    return st.sampled_from([
        ("user_int.0", [1, 11, 1], "user_int fid 1 vocab_size 10 vs 11"),
        ("user_int.1", [2, 5, 4], "user_int fid 2 dim 3 vs 4"),
        ("user_int.2", [3, 5, 1], "user_int fid 3 only in the second"),
        ("item_int.0", [1, 8, 1], "item_int fid 1 vocab_size 7 vs 8"),
        ("user_dense.0", [2, 4], "user_dense fid 2 dim 3 vs 4"),
        ("user_dense", [], "user_dense fid 2 only in the first"),
        ("seq.seq_a.features.0", [8, 51], "seq.seq_a fid 8 vocab_size 50 vs 51"),
        ("seq.seq_a.prefix", "pb", "seq.seq_a prefix pa vs pb"),
        ("seq.seq_b", {"prefix": "pb", "ts_fid": 9, "features": [[9, 0]]}, "domain seq_b only in the second"),
        ("user_int", [[2, 5, 3], [1, 10, 1]], "user_int lists its features in another order"),
    ])


@settings(max_examples=60, deadline=None)
@given(st.lists(_mutations(), min_size=1, max_size=3, unique_by=lambda m: m[0].split(".")[0]),
       st.sampled_from([None, "seq_a:3", "seq_a:300"]))
def test_schema_differences_name_each_change(mutations, max_lens):
    """Random schema mutations (one per group, up to three): each is named; the same schema under other
    sequence lengths (a run option, not the data's) has no difference."""
    raw = copy.deepcopy(VALID)
    for path, value, _ in mutations:
        raw = broken(path, value, raw)
    a, b = parse_schema(VALID), parse_schema(raw)
    found = schema_differences(a, b, limit=100)
    for _, _, phrase in mutations:
        assert any(phrase in text for text in found), (phrase, found)
    assert schema_differences(a, parse_schema(VALID, max_lens=max_lens)) == []
    assert len(schema_differences(a, b, limit=1)) == min(len(found), 2)

