"""SGLang's own request schemas, read from its wheel (downloaded with `pip download --no-deps`, never installed or
imported as a package: importing sglang needs CUDA-era dependencies).

- `/generate`: `sglang/api/v1/api_types.py` (the generated JSON contract `http_server.generate_request` runs on
  every body; needs only msgspec) plus the field names of `GenerateReqInput` (`srt/managers/io_struct.py`), whose
  dataclass parse ignores unknown top-level keys.
- the other routes: the msgspec request Structs of `io_struct.py`, executed from their source (with `BaseReq` and
  `srt/utils/msgspec_utils.py`, which need only msgspec and pydantic-core) and validated the way FastAPI does for
  `obj: Annotated[X, Body()]`; their pydantic schema ignores unknown keys, so those are refused here.
- which class a route declares: the `obj` annotation of its handler in `srt/entrypoints/http_server.py`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import types
import typing
import zipfile
from pathlib import Path

VERSION = "0.5.23"  # the wheel the schema check reads; bump it with the client
# sglang 0.5.23 ships one cp311 manylinux wheel: ask for it explicitly, whatever runs the tests.
PIP_ARGS = ["--no-deps", "--only-binary=:all:", "--implementation", "cp", "--python-version", "3.11",
            "--abi", "cp311", "--platform", "manylinux_2_34_x86_64"]


def download_wheel(cache: Path, version: str = VERSION) -> tuple[Path | None, str]:
    """The sglang wheel in `cache`, downloaded there if missing; (None, why) when pip cannot get it."""
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if found:
        return found[0], ""
    cmd = [sys.executable, "-m", "pip", "download", *PIP_ARGS, "--dest", str(cache), f"sglang=={version}"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"`{' '.join(cmd)}` failed: {e}"
    found = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if done.returncode or not found:
        return None, f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()[-400:]}"
    return found[0], ""


class SGLangSchema:
    """Validators for the request bodies of SGLang's HTTP routes, built from one wheel's source files."""

    def __init__(self, wheel: Path) -> None:
        with zipfile.ZipFile(wheel) as z:
            read = lambda name: z.read(f"sglang/{name}").decode()  # noqa: E731
            self.api_types = _module("sglang_schema_api_types", read("api/v1/api_types.py"))
            msgspec_utils = _module("sglang_schema_msgspec_utils", read("srt/utils/msgspec_utils.py"))
            io_struct = ast.parse(read("srt/managers/io_struct.py"))
            self.routes = route_bodies(ast.parse(read("srt/entrypoints/http_server.py")))
        self.classes = {node.name: node for node in io_struct.body if isinstance(node, ast.ClassDef)}
        self.generate_fields = {n.target.id for n in self.classes["GenerateReqInput"].body
                                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        self.structs = _structs(self.classes, {"Base64Bytes": msgspec_utils.Base64Bytes,
                                               "msgspec_struct_pydantic_core_schema":
                                                   msgspec_utils.msgspec_struct_pydantic_core_schema})

    def check(self, path: str, body) -> None:
        """Raise ValueError naming the path when SGLang would refuse `body` or silently ignore part of it."""
        if path not in self.routes:
            raise ValueError(f"{path}: no such route in sglang {VERSION}'s http_server.py")
        cls_name = self.routes[path]
        if cls_name is None:
            if body not in (None, {}):
                raise ValueError(f"{path} takes no body, got {body!r}")
            return
        if cls_name == "GenerateReqInput":
            unknown = set(body) - self.generate_fields
            if unknown:
                raise ValueError(f"{path}: GenerateReqInput has no field(s) {sorted(unknown)}")
            try:
                self.api_types.GenerateRequest.from_json_value(body)
            except self.api_types.JsonContractError as e:
                raise ValueError(f"{path}: {e}") from e
            return
        import msgspec
        import pydantic

        cls = self.structs[cls_name]
        unknown = set(body) - {f.name for f in msgspec.structs.fields(cls)}
        if unknown:
            raise ValueError(f"{path}: {cls_name} has no field(s) {sorted(unknown)} (SGLang would ignore them)")
        try:
            pydantic.TypeAdapter(cls).validate_json(json.dumps(body))
        except pydantic.ValidationError as e:
            raise ValueError(f"{path}: {cls_name}: {e}") from e


def route_bodies(tree: ast.Module) -> dict[str, str | None]:
    """Route path -> the class its handler's `obj` parameter is declared as (None: the route reads no body)."""
    routes: dict[str, str | None] = {}
    for fn in tree.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        paths = [d.args[0].value for d in fn.decorator_list if isinstance(d, ast.Call) and d.args
                 and isinstance(d.func, ast.Attribute) and d.func.attr in ("get", "post", "put", "api_route")
                 and isinstance(d.args[0], ast.Constant)]
        obj = next((a.annotation for a in fn.args.args if a.arg == "obj"), None)
        if isinstance(obj, ast.Subscript):  # Annotated[X, Body()]
            obj = obj.slice.elts[0] if isinstance(obj.slice, ast.Tuple) else obj.slice
        for path in paths:
            routes[path] = obj.id if isinstance(obj, ast.Name) else None
    return routes


def _module(name: str, source: str) -> types.ModuleType:
    """Execute `source` as module `name` (msgspec resolves string annotations through sys.modules)."""
    module = types.ModuleType(name)
    sys.modules[name] = module
    exec(compile(source, f"<sglang {VERSION} {name}>", "exec"), module.__dict__)
    return module


def _structs(classes: dict[str, ast.ClassDef], helpers: dict) -> dict[str, type]:
    """BaseReq and every `*ReqInput` Struct deriving from it, executed from io_struct.py's source."""
    import msgspec

    wanted = [c for name, c in classes.items() if name == "BaseReq" or
              (name.endswith("ReqInput") and any(isinstance(b, ast.Name) and b.id == "BaseReq" for b in c.bases))]
    module = types.ModuleType("sglang_schema_io_struct")
    module.__dict__.update({k: getattr(typing, k) for k in ("Annotated", "Any", "Dict", "List", "Literal",
                                                           "Optional", "Tuple", "Union")})
    module.__dict__.update(helpers, msgspec=msgspec)
    sys.modules[module.__name__] = module
    structs = {}
    for c in wanted:
        try:
            exec(compile(ast.unparse(c), "<io_struct>", "exec"), module.__dict__)
            structs[c.name] = module.__dict__[c.name]
        except (NameError, AttributeError, TypeError):  # a request this client never sends, on names outside the subset
            continue
    return structs
