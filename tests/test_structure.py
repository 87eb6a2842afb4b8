"""The package's shape holds: no import cycles, no private names imported or private
attributes reached into across modules, the command line starts without torch, and
the public listing, ``safeckpt ls`` and ``safeckpt verify`` name every folder state
the same way."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import torch

import safeckpt
from safeckpt.cli import main as cli_main
from test_corruption import future_version

PACKAGE = Path(safeckpt.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _imports(path: Path, module: str, is_package: bool):
    """(imported module, names) for every import at run time (``if TYPE_CHECKING:``
    blocks are for type checkers only and are left out)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", "") == "TYPE_CHECKING" for n in ast.walk(node)}
    base = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            where = base[:len(base) - node.level + 1] if node.level else []
            target = ".".join(where + ([node.module] if node.module else [])) if node.level else node.module
            yield target, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def test_no_module_imports_a_module_that_imports_it_back():
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in modules.items():
        deps = set()
        for target, names in _imports(path, module, is_package):
            deps |= {f"{target}.{n}" for n in names if f"{target}.{n}" in modules} or {target}
        graph[module] = {d for d in deps if d in modules and d != module and d != "safeckpt"}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m == goal:
                return True
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        return False

    cycles = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps if reaches(b, a))
    assert not cycles, cycles


def test_no_private_name_is_imported_from_another_module():
    modules = _modules()
    found = []
    for module, (path, is_package) in modules.items():
        for target, names in _imports(path, module, is_package):
            if target and target.startswith("safeckpt"):
                found += [f"{module}: {target}.{n}" for n in names if n.startswith("_") and n != "__version__"]
    assert not found, found


def _defined(tree: ast.AST) -> set[str]:
    """Every name a module defines: its functions, classes and variables, and the
    attributes it assigns (``self._x = ...``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            out.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
    return out


def _classes(tree: ast.AST) -> dict[str, tuple[list[str], set[str]]]:
    """Each class a module defines: the names of its bases, and the names it defines."""
    return {node.name: ([b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases],
                        _defined(node)) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def test_no_module_reaches_into_another_modules_private_attributes():
    """``obj._name`` (not on ``self`` or ``cls``) is for names the module itself defines
    (another instance of its own class) or that a class it extends defines (a class
    family shares its protected members); a private attribute or method of another
    module's class is that module's business: it hands over a callable or gives it a
    public name (``self.manager._check_lease()`` from another module was how this read
    before)."""
    trees = {module: ast.parse(path.read_text()) for module, (path, _) in _modules().items()}
    classes = {name: info for tree in trees.values() for name, info in _classes(tree).items()}
    allowed = {}
    for module, tree in trees.items():
        allowed[module] = _defined(tree)
        bases = [b for own, _ in _classes(tree).values() for b in own]
        while bases:  # what the classes it extends define, all the way up
            base = bases.pop()
            if base in classes:
                allowed[module] |= classes[base][1]
                bases += classes[base][0]
    ours = set().union(*(_defined(tree) for tree in trees.values()))
    found = sorted(f"{module}:{node.lineno}: .{node.attr}" for module, tree in trees.items() for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                   and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                   and node.attr in ours and node.attr not in allowed[module])
    assert not found, found


def test_the_command_line_starts_without_torch():
    code = ("import sys\nfrom safeckpt.cli import main\nassert main(['--help']) == 0\n"
            "assert main(['--version']) == 0\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[-1] == "False", out


def test_listing_ls_and_verify_name_every_state_alike(tmp_path, capsys):
    root = tmp_path / "run"
    for step in (1, 2, 3, 4):
        safeckpt.save({"w": torch.arange(64.0) + step}, root / f"step-{step:09d}", step=step)
    torn = root / "step-000000002"
    next(torn.glob("manifest-*.json")).unlink()
    corrupt = root / "step-000000003"
    next(corrupt.glob("manifest-*.json")).write_bytes(b'{"safeckpt": 2, torn')
    future_version(root / "step-000000004")
    (root / "step-000000005").mkdir()
    retired = root / "step-000000006"
    retired.mkdir()
    (retired / "safeckpt-retired").write_bytes(b"retired\n")
    expected = ["committed", "torn", "corrupt", "newer_format", "empty", "retired"]

    listed = safeckpt.list_checkpoints(root)
    assert [c.state.value for c in listed] == expected
    assert [c.step for c in listed] == [1, 2, 3, 4, 5, 6]
    assert listed[0].committed and listed[0].bytes > 256 and listed[0].tensor_count == 1
    assert all(c.problem for c in listed[1:5]) and "upgrade" in listed[3].problem
    assert listed[1].bytes > 0 and listed[1].tensor_count is None  # a torn save's files are counted

    assert cli_main(["ls", str(root), "--json"]) == 0
    assert [r["status"] for r in json.loads(capsys.readouterr().out)] == expected
    assert cli_main(["verify", str(root), "--json"]) == 1  # corrupt, and a newer format it cannot check
    verdicts = json.loads(capsys.readouterr().out)
    assert [v["status"] for v in verdicts] == expected
    assert cli_main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    for c in listed:
        assert c.state.label in out
    assert "1 committed, 1 torn, 1 corrupt, 1 newer format, 1 empty, 1 retired" in out


def test_ls_show_and_verify_read_checkpoints_without_torch(tmp_path):
    """``safeckpt ls``, ``show``, ``verify`` and ``gc`` decode and check manifests and
    data without importing torch (seconds on every call), dtypes, devices and sizes among
    the values included (``show`` imports torch only to display such a value); a folder of
    sealed files too."""
    model = torch.nn.Linear(3, 2)
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters()), "step": 3}
    safeckpt.save(state, tmp_path / "run" / "step-000000003", step=3, metadata={"lr": (0.1, float("nan"))})
    safeckpt.save({**state, "dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3])},
                  tmp_path / "run" / "step-000000004", step=4)
    sealed = tmp_path / "sealed"
    sealed.mkdir()
    (sealed / "trainer_state.json").write_text("{}")
    safeckpt.seal(sealed)
    commands = [["ls", str(tmp_path / "run")], ["ls", str(tmp_path / "run"), "--json"],
                ["show", str(tmp_path / "run" / "step-000000003")],
                ["show", str(tmp_path / "run" / "step-000000003"), "--json"], ["show", str(sealed)],
                ["verify", str(tmp_path / "run"), str(sealed)], ["gc", str(tmp_path / "run"), "--dry-run"]]
    code = ("import sys\nfrom safeckpt.cli import main\n"
            f"for args in {commands!r}:\n    assert main(args) == 0, args\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert p.stderr.splitlines()[-1] == "False", p.stderr
    assert "2 committed" in p.stdout and "(0.1, nan)" in p.stdout and "0.999" in p.stdout, p.stdout
    assert "checked 3 checkpoint folder(s)" in p.stdout and "every checksum matches" in p.stdout, p.stdout


def test_the_dtype_table_is_the_installed_torchs():
    """Manifests are decoded with ``format.dtypes.ITEMSIZES`` (no torch): it must name
    every storable dtype of the installed torch with its item size."""
    from safeckpt.format.dtypes import ITEMSIZES, torch_dtypes

    have = {name: d.itemsize for name, d in torch_dtypes().items()}
    assert {n: s for n, s in ITEMSIZES.items() if n in have} == {n: have[n] for n in ITEMSIZES if n in have}
    assert not set(have) - set(ITEMSIZES), f"add to format/dtypes.py ITEMSIZES: {sorted(set(have) - set(ITEMSIZES))}"
