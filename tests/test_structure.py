"""How the files fit: imports go one way (nothing beside train_gpt2.py imports it, and the modules beside it form no
circle), and benchmarks/ use only the names train_gpt2.py declares public (its __all__)."""
import ast
import glob
import os

import train_gpt2
from helpers import REPO

PRODUCT = {os.path.basename(path)[:-3]: path for path in glob.glob(os.path.join(REPO, "*.py"))}


def imported(path):
    """The modules a file imports (their first name), and the names it takes from train_gpt2 (from-imports and
    train_gpt2.NAME)."""
    modules, names = set(), set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            modules |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module.split(".")[0])
            if node.module == "train_gpt2":
                names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "train_gpt2":
            names.add(node.attr)
    return modules, names


def test_nothing_beside_the_trainer_imports_it_and_its_modules_form_no_circle():
    graph = {name: imported(path)[0] & set(PRODUCT) - {name} for name, path in PRODUCT.items()}
    assert "train_gpt2" in graph and len(graph) >= 10, sorted(graph)
    assert [name for name, uses in graph.items() if "train_gpt2" in uses] == []
    done, on_path = set(), []

    def visit(name):  # depth first: a module met again on the path that led to it closes a circle
        assert name not in on_path, " -> ".join(on_path[on_path.index(name):] + [name])
        if name not in done:
            on_path.append(name)
            for used in graph[name]:
                visit(used)
            on_path.pop()
            done.add(name)

    for name in graph:
        visit(name)


def test_benchmarks_use_only_the_trainers_public_names():
    public = set(train_gpt2.__all__)
    assert all(hasattr(train_gpt2, name) for name in public)
    for path in glob.glob(os.path.join(REPO, "benchmarks", "*.py")):
        _, names = imported(path)
        assert names <= public, f"{os.path.basename(path)} uses {sorted(names - public)}, not in train_gpt2.__all__"
