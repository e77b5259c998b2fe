"""Drafter kinds behind one interface (rollout/speculative/drafters.py): no code outside
the registry compares a kind's name or probes a drafter's attributes, and a new kind is
one file plus one registration line: a toy kind (tests/support/repeat_kind.py) is
attached from its config value, drafts exactly (chi-square at T=1), and shows in the
metrics, the memory model and the report without any other change. A kind's own
settings are its section of ``rollout.speculative.kinds`` (config/kinds/), never fields
of the shared ``rollout.speculative``."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import megatron_tlt
from megatron_tlt.config import (Config, ConfigError, RolloutConfig, SpeculativeConfig,
                                 load_config)
from megatron_tlt.config.kinds import KindSection, KindSettings
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.speculative import drafter_kind, drafters, model_free
from repeat_kind import RepeatLast
from test_speculative import (DIST_DRAWS, P_MIN, _chi2_pvalue, _exact_joint,
                              _sample_continuations, one_layer)  # noqa: F401

PACKAGE = Path(megatron_tlt.__file__).parent
TOOLS = PACKAGE.parent / "tools"
# attributes of drafters, their decoders and runners that only the registry may probe
PROBED = {"make_decoder", "kind", "decoders", "refreshes", "refresh_seconds", "drafter",
          "fp8", "runner_for", "token_runner", "trainable", "saveable", "feature_layers",
          "model", "fed", "name", "label", "propose", "graphed_drafting"}
# files whose names coincide with a kind's without naming it: the drafter loss preset
# "eagle" is the EAGLE recipe's loss (any kind's drafter may be trained with it)
NOT_KINDS = {"megatron_tlt/config/drafter_loss.py"}
DRAFTER_CLASSES = {"Drafter", "EagleDrafter", "EagleKind", "SelfDrafter", "DraftRunner",
                   "SelfDraftRunner", "SpeculativeDecoder", "SelfDraftDecoder", "KindDecoder",
                   "ModelFreeDrafter", "ModelFreeDecoder"}


def registry_files() -> set[Path]:
    """The registry and the kinds' own files."""
    mods = [drafters, drafter_kind, model_free] + [inspect.getmodule(k) for k in drafters.KINDS]
    return {Path(inspect.getsourcefile(m)).resolve() for m in mods}


# what a drafter is, that code outside the registry must not switch on (a kind answers
# through its methods instead: ``token_runner``, ``model``, ``make_decoder``, ...)
SWITCHED = {"fed"}


def kind_words() -> set[str]:
    """The kinds' names and the other config words they own (EAGLE's ``random``)."""
    return set(drafters.names()) | {w for k in drafters.KINDS for w in k.words}


def violations(source: str, names: set[str], where: str = "<src>") -> list[str]:
    """Kind names or words compared, used as dict keys or subscripts or prefixes
    (``.startswith``), a drafter's ``fed`` compared, drafter attributes probed with
    hasattr / getattr(..., default), drafter classes tested with isinstance."""
    out = []

    def named(node) -> bool:
        if isinstance(node, ast.Constant) and node.value in names:
            return True
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(
            isinstance(e, ast.Constant) and e.value in names for e in node.elts)

    for node in ast.walk(ast.parse(source)):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Compare) and any(named(x) for x in [node.left, *node.comparators]):
            out.append(f"{line}: compares a drafter kind's name")
        elif isinstance(node, ast.Compare) and any(
                isinstance(x, ast.Attribute) and x.attr in SWITCHED
                for x in [node.left, *node.comparators]):
            out.append(f"{line}: switches on what a drafter is fed")
        elif isinstance(node, ast.Dict) and any(k is not None and named(k) for k in node.keys):
            out.append(f"{line}: a drafter kind's name as a dict key")
        elif isinstance(node, ast.Subscript) and named(node.slice):
            out.append(f"{line}: a drafter kind's name as a subscript")
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(
                f, ast.Attribute) else ""
            args = node.args
            if fname == "get" and args and named(args[0]):
                out.append(f"{line}: looks a drafter kind's name up")
            if fname == "startswith" and args and named(args[0]):
                out.append(f"{line}: parses a drafter kind's value")
            if (fname == "hasattr" or (fname == "getattr" and len(args) == 3)) and \
                    len(args) >= 2 and isinstance(args[1], ast.Constant) and \
                    args[1].value in PROBED:
                out.append(f"{line}: probes attribute {args[1].value!r}")
            if fname == "isinstance" and len(args) == 2:
                classes = args[1].elts if isinstance(args[1], ast.Tuple) else [args[1]]
                for c in classes:
                    cname = c.id if isinstance(c, ast.Name) else getattr(c, "attr", "")
                    if cname in DRAFTER_CLASSES:
                        out.append(f"{line}: isinstance against {cname}")
    return out


def test_no_kind_names_or_drafter_probes_outside_the_registry():
    names = kind_words()
    assert "random" in names  # EAGLE's untrained drafter: parsed in kind_eagle.py only
    skip = registry_files()
    found = []
    for path in sorted([*PACKAGE.rglob("*.py"), *TOOLS.glob("*.py")]):
        if path.resolve() in skip or str(path.relative_to(PACKAGE.parent)) in NOT_KINDS:
            continue
        found += violations(path.read_text(), names, str(path.relative_to(PACKAGE.parent)))
    assert not found, ("the drafter kinds are reached only through "
                       "rollout/speculative/drafters.py and the Drafter interface:\n"
                       + "\n".join(found))


def shared_leaks(section, words: set[str]) -> list[str]:
    """Fields of the shared ``rollout.speculative`` section that are one kind's: named
    after a kind (``self_group``: the kind's name or word and a field) or documented as
    one kind's setting (``drafter=self: ...``). A kind's settings live in its own
    section (config/kinds/: ``rollout.speculative.kinds.<kind>``)."""
    out = []
    for f in dataclasses.fields(section):
        text = f.metadata.get("help", "")
        owner = next((w for w in sorted(words) if f.name.startswith(w + "_")
                      or text.startswith((f"drafter={w}:", f"drafter={w} "))), None)
        if owner is not None:
            out.append(f"{section.__name__}.{f.name}: a setting of kind {owner!r}; move it "
                       f"to its section (rollout.speculative.kinds.{owner})")
    return out


def config_sections(cls) -> list[type]:
    """Every section under ``cls`` but the kinds' own (``rollout.speculative.kinds``)."""
    out = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory
        if dataclasses.is_dataclass(sub) and sub is not KindSettings:
            out += [sub, *config_sections(sub)]
    return out


def test_kind_settings_live_in_the_kinds_sections():
    """No kind's setting on the shared section, and the two registrations agree: each
    section of ``rollout.speculative.kinds`` is a registered kind's, under its name, and
    is the section that kind reads (``Drafter.settings_section``)."""
    shared = [SpeculativeConfig, *config_sections(Config)]
    assert not [x for section in shared for x in shared_leaks(section, kind_words())]
    registered = {f.name: f.default_factory for f in dataclasses.fields(KindSettings)}
    declared = {k.name: k.settings_section for k in drafters.KINDS if k.settings_section}
    assert registered == declared
    for name, section in registered.items():
        assert issubclass(section, KindSection)
        assert all(f.metadata.get("help") for f in dataclasses.fields(section)), name
        # an old flat key names the kind's new key
        for old, new in section.renamed.items():
            with pytest.raises(ConfigError, match=f"rollout.speculative.kinds.{name}.{new}"):
                load_config(overrides=[f"rollout.speculative.{old}=1"])


def test_the_settings_scan_bites():
    @dataclasses.dataclass
    class Leaky:
        threshold: int = dataclasses.field(default=1, metadata={"help": "shared"})
        self_group: int = dataclasses.field(default=0, metadata={"help": "x"})
        depth: int = dataclasses.field(default=0, metadata={"help": "drafter=eagle: x"})
        eagle_depth: int = dataclasses.field(default=0, metadata={"help": "x"})

    found = shared_leaks(Leaky, {"self", "eagle"})
    assert [x.split(":")[0] for x in found] == ["Leaky.self_group", "Leaky.depth",
                                                "Leaky.eagle_depth"], found


def test_the_scan_bites():
    src = '''
if drafter.kind == "self": pass
if value in ("", "eagle"): pass
colors = {"eagle": 1}
x = spec["self"]; y = spec.get("eagle")
z = getattr(d, "refreshes", 0); w = hasattr(spec, "decoders")
v = isinstance(d, SelfDrafter)
ok = getattr(d, "refreshes"); fine = name == "plain"; also = {"plain": 1}
if arg == "random": arg = "random:1024"
if arg.startswith("random"): pass
if d.fed == "features": pass
'''
    found = violations(src, {"self", "eagle", "random"})
    assert len(found) == 11, found


# ------------------------------------------------------------------------- a new kind
@pytest.fixture
def repeat_kind():
    drafters.register(RepeatLast)  # the one registration line
    yield RepeatLast
    drafters.unregister(RepeatLast)


def test_a_toy_kind_drafts_exactly_and_shows_everywhere(one_layer, repeat_kind):  # noqa: F811
    model, arch, _, _ = one_layer
    d = drafters.make_drafter("repeat", arch=arch, dtype=torch.float32, device="cpu")
    assert isinstance(d, RepeatLast) and d.name in drafters.names()
    # attached from its config value, drafting 3-token chains in every step
    sc = SpeculativeConfig(drafter="repeat", policy="fixed", strategy="3_1_3",
                           threshold=1 << 20)
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc, max_batch_size=2500),
                        arch=arch, eos_token_ids=[])
    assert list(eng.drafters) == ["repeat"]
    # exact at T=1 with top-p: the target's joint distribution of 3-token continuations
    sp = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=3)
    prompt = [7, 100, 33, 250, 3]
    counts = _sample_continuations(eng, prompt, sp, DIST_DRAWS)
    summ = eng.last_stats.spec.summary()
    assert summ["kinds"]["repeat"]["steps"] > 0 and summ["drafted_per_row"] > 1
    pval = _chi2_pvalue(counts, _exact_joint(model, arch, prompt, sp, 3), DIST_DRAWS)
    assert pval > P_MIN, pval
    # greedy: the same tokens as plain decoding
    plain = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    g = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompts = [[5, 9, 9, 9], [1, 2, 3], [42] * 6]
    assert [o.token_ids for o in eng.generate(prompts, g)] == \
        [o.token_ids for o in plain.generate(prompts, g)]
    # the step's metrics (spec/repeat/...), the dry run's kinds and the plot's bands
    from megatron_tlt.rl import memory_model
    from megatron_tlt.rl.report import kind_color
    from megatron_tlt.rl.spec_metrics import merge_spec

    merged = merge_spec([eng.last_stats.spec.summary()], 10)
    assert "repeat" in merged["kinds"] and merged["repeat"]["steps"] > 0
    cfg = load_config(overrides=["rollout.speculative.drafter=repeat"])
    assert drafters.configured_kinds(cfg) == [RepeatLast]
    est = memory_model.estimate(cfg, arch, 1)
    assert est.settings.kinds == (RepeatLast,) and est.peak > 0
    assert kind_color("repeat") == "tab:olive"
