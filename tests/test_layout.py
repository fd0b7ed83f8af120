"""The package layout (ARCHITECTURE.md): data flows one way between rooms, and the library never imports
the applications built on it. Every import counts, those inside functions too."""

import ast
from pathlib import Path

import lightgen

PACKAGE = Path(lightgen.__file__).parent
# Rooms that make up the library, lowest first; each may import only rooms listed before it (and itself).
LIBRARY = ["_compat", "_build", "ops", "memory", "modules", "generation", "adapters"]
# Applications on the library: they may import the library and each other, never the reverse.
APPLICATIONS = {"__init__", "drafting", "drafter_cli", "env", "cli", "machine", "demo", "serving", "integrations"}
# _build registers the ops' reference kernels when the extension cannot be built (its only upward import).
ALLOWED_UPWARD = {("_build", "ops")}


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "lightgen":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    """The lightgen rooms ``path`` imports."""
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            rooms |= {_room(alias.name) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "lightgen":  # `from lightgen import ops` names a room; other names are the API
                rooms |= {alias.name if (PACKAGE / alias.name).is_dir() or (PACKAGE / f"{alias.name}.py").is_file()
                          else "__init__" for alias in node.names}
            else:
                rooms.add(_room(node.module))
    return rooms - {None}


def _edges() -> set[tuple[str, str]]:
    edges = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        source = relative.parts[0].removesuffix(".py")
        edges |= {(source, target) for target in _imports(path) if target != source}
    return edges


def test_every_module_belongs_to_a_room():
    rooms = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in PACKAGE.rglob("*.py")}
    assert rooms <= set(LIBRARY) | APPLICATIONS, rooms - set(LIBRARY) - APPLICATIONS


def test_library_rooms_import_only_rooms_below_them():
    wrong = [(source, target) for source, target in _edges() if source in LIBRARY and (source, target)
             not in ALLOWED_UPWARD and (target not in LIBRARY or LIBRARY.index(target) > LIBRARY.index(source))]
    assert not wrong, f"library imports against the layering: {sorted(wrong)}"


def test_no_import_circle_between_rooms():
    edges = _edges() - ALLOWED_UPWARD
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)

    def reaches(start, goal, seen):
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt}))
                   for nxt in graph.get(start, ()))

    circles = sorted(room for room in graph if reaches(room, room, {room}))
    assert not circles, f"rooms on an import circle: {circles}"


def test_the_layout_check_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from lightgen.demo import MODEL_DIR\n    import lightgen.serving.core\n"
                      "    from lightgen import ops, accelerate_model\n")
    assert _imports(module) == {"demo", "serving", "ops", "__init__"}
