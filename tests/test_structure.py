"""How the files fit. The scripts (train_gpt2.py, fineweb.py, plot.py) may import every folder; variations/ and
evaluation/ import machinery/ and their own folder (the modern recipe uses the losses); machinery/ imports only
itself; nothing imports the scripts, and no modules form a circle. benchmarks/ use only the trainer's names listed
here. And what one training step and one checkpoint save run through, and the longest chain of imports, measured."""
import ast
import glob
import os
import re
import signal
import sys

import pytest

import train_gpt2
from helpers import REPO, TINY, write_shards
from machinery import settings

SCRIPTS = {"train_gpt2", "fineweb", "plot"}
FOLDERS = ("machinery", "variations", "evaluation")
MAY_IMPORT = {"machinery": {"machinery"}, "variations": {"machinery", "variations"},
              "evaluation": {"machinery", "evaluation"}}
# what benchmarks/ may take from train_gpt2.py: every other name of it may change freely
TRAINER_NAMES = {"TrainConfig", "parse_args", "draft_config", "final_config", "MODEL_SIZES", "PADDED_VOCAB",
                 "GPTConfig", "GPT", "model_of", "make_model", "make_optimizers", "set_lr", "set_up_distributed",
                 "tear_down_distributed", "set_tf32", "autocast_context", "compile_model", "train_step",
                 "evaluate_val", "SHAKESPEARE", "cross_entropy", "RECIPES"}


def product_modules():
    """{module name as imported (machinery.settings, train_gpt2): its path} of the scripts and the folders."""
    modules = {name: os.path.join(REPO, f"{name}.py") for name in SCRIPTS}
    for folder in FOLDERS:
        for path in glob.glob(os.path.join(REPO, folder, "*.py")):
            name = os.path.basename(path)[:-3]
            modules[folder if name == "__init__" else f"{folder}.{name}"] = path
    return modules


def imported(path, known):
    """The product's modules a file imports (from machinery import settings: machinery.settings), and the names it
    takes from train_gpt2 (from-imports and train_gpt2.NAME)."""
    modules, names = set(), set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
            if node.module == "train_gpt2":
                names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "train_gpt2":
            names.add(node.attr)
    return {module for module in modules if module in known}, names


def import_graph():
    modules = product_modules()
    return {name: imported(path, modules)[0] - {name, name.split(".")[0]} for name, path in modules.items()}


def test_the_folders_import_one_way_and_nothing_imports_the_scripts():
    graph = import_graph()
    assert len(graph) >= 20 and SCRIPTS <= set(graph), sorted(graph)
    for name, uses in graph.items():
        assert not uses & SCRIPTS, f"{name} imports {sorted(uses & SCRIPTS)}"
        folder = name.split(".")[0]
        if folder in MAY_IMPORT:
            wrong = {used for used in uses if used.split(".")[0] not in MAY_IMPORT[folder]}
            assert not wrong, f"{name} imports {sorted(wrong)}: {folder}/ imports only {sorted(MAY_IMPORT[folder])}/"


def longest_chain(graph):
    """The longest path of imports (module -> a module it imports -> ...), as a list; none closes a circle."""
    longest, on_path = {}, []

    def visit(name):  # depth first: a module met again on the path that led to it closes a circle
        assert name not in on_path, " -> ".join(on_path[on_path.index(name):] + [name])
        if name not in longest:
            on_path.append(name)
            longest[name] = [name] + max((visit(used) for used in graph[name]), key=len, default=[])
            on_path.pop()
        return longest[name]

    return max((visit(name) for name in graph), key=len)


def test_no_modules_form_a_circle_and_no_chain_of_imports_is_long():
    chain = longest_chain(import_graph())
    assert len(chain) <= 7, " -> ".join(chain)  # 2026-11-28: 7 (the aim: 5)


def words_of(text):
    """The words of an identifier or a text, lowercased: split at what is no letter or digit, and at CamelCase."""
    parts = [part for part in re.split(r"[^A-Za-z0-9]+", text) if part]
    return {word.lower() for part in parts
            for word in [part, *re.findall(r"[A-Z]+[0-9]*(?![a-z])|[A-Z]?[a-z]+[0-9]*|[0-9]+", part)]}


def code_of(path):
    """(line, text) of every identifier and string of a module's code; not its docstrings (nor comments: ast has
    none)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node.lineno, node.value
        for field in ("id", "attr", "name", "arg", "asname"):
            if isinstance(getattr(node, field, None), str):
                yield node.lineno, getattr(node, field)


def recipe_and_benchmark_names():
    """The words that name a recipe or a benchmark, and the whole names (a recipe's, its own settings), and their
    flags. Derived from train_gpt2.py, so that a new recipe or benchmark is covered without editing this."""
    recipes = train_gpt2.RECIPES
    words = {"muon", "fp8", "float8"}  # the modern recipe's optimizer; the FP8 head's number format
    # "gpt2" names GPT-2's recipe, and also the BPE and vocabulary that every recipe shares: a whole name only
    words |= {name for name in recipes if name != "gpt2"}
    words |= {word for recipe in recipes.values()
              for word in (recipe.hf_format.architecture.lower(), recipe.hf_format.model_type) if word != "gpt2"}
    words |= {benchmark.NAME.lower() for benchmark in train_gpt2.BENCHMARKS}
    names = set(recipes) | {name for recipe in recipes.values() for name in recipe.settings}
    return words, names, {settings.flag(name) for name in names}


def named_recipes_and_benchmarks(path):
    words, names, flags = recipe_and_benchmark_names()
    return [(line, text) for line, text in code_of(path)
            if words_of(text) & words or text in names or any(flag in text for flag in flags)]


def test_machinery_names_no_recipe_and_no_benchmark():
    """machinery/ is the run's machinery for any recipe: a recipe's part lives in its own module (variations/,
    train_gpt2.py), a benchmark's in evaluation/, handed over as arguments. Shakespeare (the default data) and OpenAI
    (--init-from's weights) are no recipe, and train_gpt2.py hands their tables over (PRESETS, MODEL_SIZES):
    machinery decides only in which order they apply. fineweb.py's shards and manifest are the data machinery reads."""
    found = [f"{os.path.relpath(path, REPO)}:{line}: {text[:70]!r}"
             for path in sorted(glob.glob(os.path.join(REPO, "machinery", "*.py")))
             for line, text in named_recipes_and_benchmarks(path)]
    assert not found, "machinery/ names a recipe or a benchmark:\n" + "\n".join(found)


def test_the_layering_rule_reads_code_not_comments(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('"""HellaSwag, the modern recipe."""\n# muon\nEVERY = "hellaswag_every"\n'
                      'def f(x):\n    """nanochat"""\n    return x.muon_lr, "--head-lr 0.1", "gpt2", "GPT2_VOCAB"\n')
    assert sorted(text for _, text in named_recipes_and_benchmarks(module)) == [
        "--head-lr 0.1", "gpt2", "hellaswag_every", "muon_lr"]


def test_benchmarks_use_only_the_trainers_names_listed_here():
    assert all(hasattr(train_gpt2, name) for name in TRAINER_NAMES)
    for path in glob.glob(os.path.join(REPO, "benchmarks", "*.py")):
        _, names = imported(path, {})
        assert names <= TRAINER_NAMES, f"{os.path.basename(path)} uses {sorted(names - TRAINER_NAMES)} of train_gpt2"


def test_every_script_finds_the_repository_through_a_link_to_it():
    """A path taken from __file__ goes through os.path.realpath: run through a link in another directory, a script
    looked for input.txt, or for the modules it imports, beside the link (test_train.py runs one so)."""
    paths = [os.path.join(REPO, f"{name}.py") for name in SCRIPTS]
    paths += [path for folder in FOLDERS + ("benchmarks",) for path in glob.glob(os.path.join(REPO, folder, "*.py"))]
    for path in paths:
        for node in ast.walk(ast.parse(open(path).read())):
            of_file = isinstance(node, ast.Call) and any(getattr(arg, "id", None) == "__file__" for arg in node.args)
            if of_file:
                assert ast.unparse(node.func) == "os.path.realpath", f"{path}: {ast.unparse(node)}"


def modules_run(function):
    """The product's modules whose code runs while function() does (sys.setprofile sees every Python call)."""
    paths = {os.path.abspath(path): name for name, path in product_modules().items()}
    seen = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in paths:
            seen.add(paths[frame.f_code.co_filename])


    sys.setprofile(profile)
    try:
        function()
    finally:
        sys.setprofile(None)
    return seen


@pytest.fixture
def tiny_run(tmp_path):
    """A tiny run, set up as train_gpt2.start sets it up, in this process; its signal handlers put back after."""
    args = TINY + ["--data", write_shards(tmp_path / "data"), "--log-dir", tmp_path / "log", "--max-steps", "4"]
    flags, given = train_gpt2.parse_args([str(a) for a in args])
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    env = train_gpt2.set_up_distributed(flags.device, flags.fsdp)
    draft = train_gpt2.draft_config(flags, given, env)
    try:
        with train_gpt2.log_directory.locked(draft, env):
            yield train_gpt2.set_up(draft, env)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_what_one_step_and_one_save_run_through(tiny_run, capsys):
    """The modules one training step runs through (the loop's body, between its evaluations), and one checkpoint
    save: the closing note's counts, held here so that they do not grow unseen."""
    run = tiny_run

    def one_step():  # the training loop's body, as train_gpt2.train runs it
        run.before_step()
        batches = run.read_step()
        train_gpt2.set_lr(run.optimizers, run.step, run.cfg)
        run.after_step(train_gpt2.train_step(run.compiled, run.optimizers, run.scaler, batches, run.autocast_ctx,
                                             run.cfg.grad_clip))

    one_step()  # the first step imports what it needs: the second is the one counted
    step = modules_run(one_step)
    save = modules_run(run.save)
    capsys.readouterr()
    print(f"one step: {sorted(step)}; one save: {sorted(save)}")
    assert "train_gpt2" in step and "variations.losses" not in step and "machinery.checkpoints" in save
    assert len(step) <= 6, sorted(step)  # 2026-11-29: 6 (the aim: 4)
    assert len(save) <= 5, sorted(save)  # 2026-11-29: 5 (the aim: 3)
