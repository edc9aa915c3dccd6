"""The API stays compatible within a major version (docs/API.md, "Compatibility"): proto/lce/v1/lce.proto,
compiled now, against the released descriptor checked in beside it (lce.v1.descriptor.binpb).

Breaking (each a rule of buf's breaking-change checker, https://buf.build/docs/breaking/rules, by its
name there; the set is buf's PACKAGE category less its file-layout rules): a message, enum, service or
RPC removed (MESSAGE_NO_DELETE, ENUM_NO_DELETE, SERVICE_NO_DELETE, RPC_NO_DELETE); a field's number
removed (FIELD_NO_DELETE) or its name moved to another number (a renumbered field); a field renamed
(FIELD_SAME_NAME, which JSON and generated code see), its type or message/enum type changed
(FIELD_SAME_TYPE), its cardinality or presence changed (FIELD_SAME_CARDINALITY: repeated, singular,
proto3 `optional`), moved into or out of a oneof (FIELD_SAME_ONEOF); an enum value's number removed or
renamed (ENUM_VALUE_NO_DELETE, ENUM_VALUE_SAME_NAME); an RPC's request or response type or streaming
changed (RPC_SAME_REQUEST_TYPE, RPC_SAME_RESPONSE_TYPE, RPC_SAME_CLIENT_STREAMING,
RPC_SAME_SERVER_STREAMING). Anything added passes.

The checker's own tests break the released descriptor in each of those ways (and add to it in others).
"""
from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from google.protobuf import descriptor_pb2 as dpb

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "proto"
PROTO = "lce/v1/lce.proto"
RELEASED = PROTO_ROOT / "lce" / "v1" / "lce.v1.descriptor.binpb"
UPDATE_HINT = ("a breaking change needs a new major version (lce.v2); at a release, the descriptor is rewritten "
               "by `cmake --build build --target lce_api_descriptor` (docs/API.md, \"Compatibility\")")

Field = dpb.FieldDescriptorProto


# ---- the checker -------------------------------------------------------------------------------------

def _index(fds: dpb.FileDescriptorSet) -> Tuple[Dict[str, dpb.DescriptorProto], Dict[str, dpb.EnumDescriptorProto],
                                                 Dict[str, dpb.ServiceDescriptorProto]]:
    """Every message, enum and service of the set by its full name (".lce.v1.Name", as type_name writes it)."""
    messages, enums, services = {}, {}, {}

    def walk(prefix: str, msgs, enum_types) -> None:
        for e in enum_types:
            enums[f"{prefix}.{e.name}"] = e
        for m in msgs:
            name = f"{prefix}.{m.name}"
            messages[name] = m
            walk(name, m.nested_type, m.enum_type)

    for f in fds.file:
        prefix = f".{f.package}" if f.package else ""
        walk(prefix, f.message_type, f.enum_type)
        for s in f.service:
            services[f"{prefix}.{s.name}"] = s
    return messages, enums, services


def _oneof(message: dpb.DescriptorProto, field: Field) -> str:
    """The real oneof a field is in ("" for none; proto3 `optional`'s synthetic oneof is presence, not a oneof)."""
    if not field.HasField("oneof_index") or field.proto3_optional:
        return ""
    return message.oneof_decl[field.oneof_index].name


def _cardinality(field: Field) -> str:
    if field.label == Field.LABEL_REPEATED:
        return "repeated"
    if field.label == Field.LABEL_REQUIRED:
        return "required"
    return "optional (explicit presence)" if field.proto3_optional else "singular"


def _type(field: Field) -> str:
    return field.type_name or Field.Type.Name(field.type)


def _message_breaks(name: str, old: dpb.DescriptorProto, new: dpb.DescriptorProto) -> List[str]:
    out = []
    new_by_number = {f.number: f for f in new.field}
    new_by_name = {f.name: f for f in new.field}
    for f in old.field:
        where = f"{name}.{f.name} (= {f.number})"
        g = new_by_number.get(f.number)
        if g is None:
            moved = new_by_name.get(f.name)
            out.append(f"FIELD_NO_DELETE: {where} renumbered to {moved.number}" if moved is not None
                       else f"FIELD_NO_DELETE: {where} removed")
            continue
        if g.name != f.name:
            out.append(f"FIELD_SAME_NAME: {where} renamed to {g.name}")
        if _type(g) != _type(f):
            out.append(f"FIELD_SAME_TYPE: {where} changed type from {_type(f)} to {_type(g)}")
        if _cardinality(g) != _cardinality(f):
            out.append(f"FIELD_SAME_CARDINALITY: {where} changed from {_cardinality(f)} to {_cardinality(g)}")
        if _oneof(new, g) != _oneof(old, f):
            out.append(f"FIELD_SAME_ONEOF: {where} moved from oneof '{_oneof(old, f)}' to '{_oneof(new, g)}'")
    return out


def _enum_breaks(name: str, old: dpb.EnumDescriptorProto, new: dpb.EnumDescriptorProto) -> List[str]:
    out = []
    new_names = {}
    for v in new.value:
        new_names.setdefault(v.number, set()).add(v.name)  # aliases (allow_alias) share a number
    for v in old.value:
        if v.number not in new_names:
            out.append(f"ENUM_VALUE_NO_DELETE: {name}.{v.name} (= {v.number}) removed")
        elif v.name not in new_names[v.number]:
            out.append(f"ENUM_VALUE_SAME_NAME: {name}.{v.name} (= {v.number}) renamed to "
                       f"{'/'.join(sorted(new_names[v.number]))}")
    return out


def _service_breaks(name: str, old: dpb.ServiceDescriptorProto, new: dpb.ServiceDescriptorProto) -> List[str]:
    out = []
    new_methods = {m.name: m for m in new.method}
    for m in old.method:
        where = f"{name}.{m.name}"
        n = new_methods.get(m.name)
        if n is None:
            out.append(f"RPC_NO_DELETE: {where} removed")
            continue
        if n.input_type != m.input_type:
            out.append(f"RPC_SAME_REQUEST_TYPE: {where} takes {n.input_type}, was {m.input_type}")
        if n.output_type != m.output_type:
            out.append(f"RPC_SAME_RESPONSE_TYPE: {where} returns {n.output_type}, was {m.output_type}")
        if n.client_streaming != m.client_streaming:
            out.append(f"RPC_SAME_CLIENT_STREAMING: {where} client streaming {m.client_streaming} -> {n.client_streaming}")
        if n.server_streaming != m.server_streaming:
            out.append(f"RPC_SAME_SERVER_STREAMING: {where} server streaming {m.server_streaming} -> {n.server_streaming}")
    return out


def breaking_changes(old: dpb.FileDescriptorSet, new: dpb.FileDescriptorSet) -> List[str]:
    """What `new` breaks of `old`, one line a break (empty: compatible)."""
    old_msgs, old_enums, old_svcs = _index(old)
    new_msgs, new_enums, new_svcs = _index(new)
    out = []
    for kind, rule, olds, news, check in (
            ("message", "MESSAGE_NO_DELETE", old_msgs, new_msgs, _message_breaks),
            ("enum", "ENUM_NO_DELETE", old_enums, new_enums, _enum_breaks),
            ("service", "SERVICE_NO_DELETE", old_svcs, new_svcs, _service_breaks)):
        for name, o in olds.items():
            if name not in news:
                out.append(f"{rule}: {kind} {name} removed")
            else:
                out.extend(check(name, o, news[name]))
    return out


# ---- descriptors ---------------------------------------------------------------------------------------

def compile_proto(root: Path, name: str) -> dpb.FileDescriptorSet:
    """`name` under `root` compiled by grpc_tools' protoc into a descriptor set (with its imports)."""
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.binpb"
        rc = protoc.main(["protoc", f"-I{root}", f"-I{include}", "--include_imports",
                          f"--descriptor_set_out={out}", str(root / name)])
        assert rc == 0, f"protoc failed on {root / name} ({rc})"
        return dpb.FileDescriptorSet.FromString(out.read_bytes())


def released() -> dpb.FileDescriptorSet:
    return dpb.FileDescriptorSet.FromString(RELEASED.read_bytes())


def test_the_current_proto_keeps_the_released_api():
    breaks = breaking_changes(released(), compile_proto(PROTO_ROOT, PROTO))
    assert not breaks, "proto/lce/v1/lce.proto breaks the released API:\n  " + "\n  ".join(breaks) + "\n" + UPDATE_HINT


def test_the_released_descriptor_is_the_lce_v1_api():
    files = {f.name: f for f in released().file}
    assert PROTO in files and files[PROTO].package == "lce.v1"
    assert [s.name for s in files[PROTO].service] == ["LceService"]
    assert breaking_changes(released(), released()) == []


# ---- the checker's own tests: the released descriptor, broken or added to --------------------------------

def _file(fds: dpb.FileDescriptorSet) -> dpb.FileDescriptorProto:
    return next(f for f in fds.file if f.name == PROTO)


def _message(fds, name: str) -> dpb.DescriptorProto:
    return next(m for m in _file(fds).message_type if m.name == name)


def _field(fds, message: str, name: str) -> Field:
    return next(f for f in _message(fds, message).field if f.name == name)


def _enum(fds, name: str) -> dpb.EnumDescriptorProto:
    return next(e for e in _file(fds).enum_type if e.name == name)


def _method(fds, name: str) -> dpb.MethodDescriptorProto:
    return next(m for m in _file(fds).service[0].method if m.name == name)


def _remove(repeated, item) -> None:
    repeated.remove(item)


def _remove_message(fds, name: str) -> None:
    _remove(_file(fds).message_type, _message(fds, name))


def _drop_presence(field: Field) -> None:
    """proto3 `optional int32 x` -> `int32 x` (its synthetic oneof left unused)."""
    field.ClearField("proto3_optional")
    field.ClearField("oneof_index")


def _add_oneof(fds, message: str, name: str) -> int:
    """A new oneof in the message; its index."""
    m = _message(fds, message)
    m.oneof_decl.add(name=name)
    return len(m.oneof_decl) - 1


BREAKS = {
    "a field removed": (lambda d: _remove(_message(d, "RequestHeader").field, _field(d, "RequestHeader", "softcap")),
                        "FIELD_NO_DELETE: .lce.v1.RequestHeader.softcap (= 6) removed"),
    "a field renumbered": (lambda d: setattr(_field(d, "RequestHeader", "softcap"), "number", 99),
                           "FIELD_NO_DELETE: .lce.v1.RequestHeader.softcap (= 6) renumbered to 99"),
    "a field renamed": (lambda d: setattr(_field(d, "RequestHeader", "softcap"), "name", "soft_cap"),
                        "FIELD_SAME_NAME: .lce.v1.RequestHeader.softcap (= 6) renamed to soft_cap"),
    "a scalar's type changed": (lambda d: setattr(_field(d, "RequestHeader", "softcap"), "type", Field.TYPE_DOUBLE),
                                "FIELD_SAME_TYPE: .lce.v1.RequestHeader.softcap (= 6) changed type from TYPE_FLOAT to TYPE_DOUBLE"),
    "an enum field's enum changed": (
        lambda d: setattr(_field(d, "RequestHeader", "dtype"), "type_name", ".lce.v1.Reduction"),
        "FIELD_SAME_TYPE: .lce.v1.RequestHeader.dtype (= 4) changed type from .lce.v1.DType to .lce.v1.Reduction"),
    "a field made repeated": (lambda d: setattr(_field(d, "RequestHeader", "softcap"), "label", Field.LABEL_REPEATED),
                              "FIELD_SAME_CARDINALITY: .lce.v1.RequestHeader.softcap (= 6) changed from singular to repeated"),
    "a field's presence dropped": (
        lambda d: _drop_presence(_field(d, "RequestHeader", "temperature")),
        "FIELD_SAME_CARDINALITY: .lce.v1.RequestHeader.temperature (= 5) changed from optional (explicit presence) to singular"),
    "a field moved into a oneof": (
        lambda d: setattr(_field(d, "RequestHeader", "softcap"), "oneof_index", _add_oneof(d, "RequestHeader", "choice")),
        "FIELD_SAME_ONEOF: .lce.v1.RequestHeader.softcap (= 6) moved from oneof '' to 'choice'"),
    "a message removed": (lambda d: _remove_message(d, "HeadDescription"),
                          "MESSAGE_NO_DELETE: message .lce.v1.HeadDescription removed"),
    "an enum value removed": (lambda d: _remove(_enum(d, "Output").value, _enum(d, "Output").value[-1]),
                              "ENUM_VALUE_NO_DELETE: .lce.v1.Output.OUTPUT_LOSS (= 3) removed"),
    "an enum value renamed": (lambda d: setattr(_enum(d, "DType").value[2], "name", "DTYPE_BF16"),
                              "ENUM_VALUE_SAME_NAME: .lce.v1.DType.DTYPE_BFLOAT16 (= 2) renamed to DTYPE_BF16"),
    "an enum removed": (lambda d: _remove(_file(d).enum_type, _enum(d, "Output")),
                        "ENUM_NO_DELETE: enum .lce.v1.Output removed"),
    "an RPC removed": (lambda d: _remove(_file(d).service[0].method, _method(d, "GetInfo")),
                       "RPC_NO_DELETE: .lce.v1.LceService.GetInfo removed"),
    "an RPC's request type changed": (
        lambda d: setattr(_method(d, "ZeroGrad"), "input_type", ".lce.v1.GetInfoRequest"),
        "RPC_SAME_REQUEST_TYPE: .lce.v1.LceService.ZeroGrad takes .lce.v1.GetInfoRequest, was .lce.v1.ZeroGradRequest"),
    "an RPC's response type changed": (
        lambda d: setattr(_method(d, "GetInfo"), "output_type", ".lce.v1.HeadDescription"),
        "RPC_SAME_RESPONSE_TYPE: .lce.v1.LceService.GetInfo returns .lce.v1.HeadDescription, was .lce.v1.GetInfoResponse"),
    "an RPC no longer client-streaming": (
        lambda d: setattr(_method(d, "Score"), "client_streaming", False),
        "RPC_SAME_CLIENT_STREAMING: .lce.v1.LceService.Score client streaming True -> False"),
    "an RPC made server-streaming": (
        lambda d: setattr(_method(d, "GetInfo"), "server_streaming", True),
        "RPC_SAME_SERVER_STREAMING: .lce.v1.LceService.GetInfo server streaming False -> True"),
    "the service removed": (lambda d: _file(d).ClearField("service"),
                            "SERVICE_NO_DELETE: service .lce.v1.LceService removed"),
    "the package renamed": (lambda d: setattr(_file(d), "package", "lce.v2"),
                            "MESSAGE_NO_DELETE: message .lce.v1.RequestHeader removed"),
}


@pytest.mark.parametrize("change", sorted(BREAKS))
def test_the_checker_fails_a_breaking_change(change):
    before = released()
    after = copy.deepcopy(before)
    mutate, expected = BREAKS[change]
    mutate(after)
    breaks = breaking_changes(before, after)
    assert expected in breaks, breaks


ADDITIONS = {
    "a field": lambda d: _message(d, "RequestHeader").field.add(
        name="new_knob", number=1000, type=Field.TYPE_FLOAT, label=Field.LABEL_OPTIONAL, json_name="newKnob"),
    "a message": lambda d: _file(d).message_type.add(name="NewThing").field.add(
        name="x", number=1, type=Field.TYPE_INT64, label=Field.LABEL_OPTIONAL),
    "an enum value": lambda d: _enum(d, "Output").value.add(name="OUTPUT_NEW", number=99),
    "an enum": lambda d: _file(d).enum_type.add(name="NewEnum").value.add(name="NEW_ENUM_UNSPECIFIED", number=0),
    "an RPC": lambda d: _file(d).service[0].method.add(
        name="NewCall", input_type=".lce.v1.GetInfoRequest", output_type=".lce.v1.GetInfoResponse"),
    "a service": lambda d: _file(d).service.add(name="NewService"),
    "a new oneof of a new field": lambda d: _message(d, "RequestHeader").field.add(
        name="fresh_a", number=1001, type=Field.TYPE_INT32, label=Field.LABEL_OPTIONAL,
        oneof_index=_add_oneof(d, "RequestHeader", "fresh")),
    "the fields reordered, numbers kept": lambda d: _message(d, "RequestHeader").field.reverse(),
}


@pytest.mark.parametrize("change", sorted(ADDITIONS))
def test_the_checker_passes_an_addition(change):
    before = released()
    after = copy.deepcopy(before)
    ADDITIONS[change](after)
    assert after != before
    assert breaking_changes(before, after) == []


def test_the_checker_reads_protos_as_written(tmp_path):
    """The same rules on source text, compiled the way the main test compiles lce.proto."""
    def descriptor(text: str) -> dpb.FileDescriptorSet:
        (tmp_path / "t.proto").write_text('syntax = "proto3";\npackage t;\n' + text)
        return compile_proto(tmp_path, "t.proto")

    before = descriptor("message A { int32 x = 1; string y = 2; }\nservice S { rpc M(A) returns (stream A); }")
    added = descriptor("message A { int32 x = 1; string y = 2; repeated float z = 3; }\nmessage B {}\n"
                       "service S { rpc M(A) returns (stream A); rpc N(B) returns (B); }")
    renumbered = descriptor("message A { int32 x = 1; string y = 3; }\nservice S { rpc M(A) returns (stream A); }")
    unary = descriptor("message A { int32 x = 1; string y = 2; }\nservice S { rpc M(A) returns (A); }")
    assert breaking_changes(before, added) == []
    assert breaking_changes(before, renumbered) == ["FIELD_NO_DELETE: .t.A.y (= 2) renumbered to 3"]
    assert breaking_changes(before, unary) == ["RPC_SAME_SERVER_STREAMING: .t.S.M server streaming True -> False"]
