"""The per-block planner (issue 11): a strategy per block, priced by measured time.

- the dynamic program is exact for its model: on random menus it finds a plan as fast as
  exhaustive search (within the rounding of its byte grid), and every answer fits;
- with stages (a run of blocks as one unit) on the menu, the same holds;
- on a real 6-block model, the plan's predicted time is within 3% of the best plan exhaustive
  search finds over the same measured menu;
- the plan's config runs exactly the chosen strategies, exactly (gradients equal), and fits;
- ``resolve_auto``, the CLI's ``suggest --out`` and ``profile --frontier`` use it.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from _models import TinyViT

import vision_ckpt
from vision_ckpt import CheckpointConfig, ConfigError
from vision_ckpt.cli.main import main
from vision_ckpt.measure import Measurement
from vision_ckpt.measure._memory import track_peak_memory
from vision_ckpt.tune._optimise import (
    Block,
    Option,
    StageOption,
    choose,
    choose_exhaustively,
    predict,
)
from vision_ckpt.tune.profiling import default_loss, plan_for_budget, planner_frontier, resolve_auto


def _per_block(result):
    """The per-block plan of a result: itself, or the one a faster uniform level beat (which
    must then be predicted no faster than that level)."""
    if result.uniform_level is None:
        return result
    level = result.uniform[result.uniform_level]
    assert level.seconds is not None  # it fits, so it was timed
    assert result.config.training_checkpoint_level == result.uniform_level
    if result.per_block is not None:
        assert level.seconds < result.per_block.measurement.seconds
    return result.per_block


def _random_blocks(rng: random.Random, n: int) -> list[Block]:
    blocks = []
    for i in range(n):
        keep = rng.randint(50, 400)
        sel = rng.randint(keep // 4, keep)
        full = rng.randint(1, sel)
        nested = full
        options = [
            Option("keep", keep, 0, 0.0),
            Option("selective", sel, keep - sel, rng.uniform(0.01, 0.3)),
            Option("full", full, keep - full, rng.uniform(0.3, 1.0)),
            Option("nested", nested, (keep - full) // 3, rng.uniform(1.0, 1.5)),
        ]
        blocks.append(Block(str(i), tuple(options[: rng.randint(2, 4)])))
    return blocks


@pytest.mark.parametrize("seed", range(40))
def test_the_program_matches_exhaustive_search(seed: int) -> None:
    rng = random.Random(seed)
    blocks = _random_blocks(rng, rng.randint(1, 6))
    base = rng.randint(0, 200)
    everything = predict(blocks, [b.options[0] for b in blocks], base)[0]
    smallest = predict(blocks, [min(b.options, key=lambda o: o.kept) for b in blocks], base)[0]
    budget = rng.randint(base, everything + 10)
    exact = choose_exhaustively(blocks, base, budget)
    found = choose(blocks, base, budget, resolution=4096)
    if exact is None:
        assert found is None
        return
    if found is None:  # only possible within one grid step per block of the budget
        assert exact.peak > budget - len(blocks) * max(1, (budget - base) // 4096)
        return
    assert found.peak <= budget and found.peak == predict(blocks, found.options, base)[0]
    assert found.time <= exact.time * 1.03 + 1e-9
    assert smallest <= everything


def _random_spans(rng: random.Random, blocks: list[Block]) -> list[StageOption]:
    spans = []
    for _ in range(rng.randint(0, 3)):
        if len(blocks) < 2:
            break
        first = rng.randrange(len(blocks) - 1)
        last = rng.randrange(first + 1, len(blocks))
        keep = sum(b.options[0].kept for b in blocks[first : last + 1])
        kept = rng.randint(keep // 5, keep)
        option = Option("stage", kept, keep - kept, rng.uniform(0.01, 0.5))
        spans.append(StageOption(f"s{first}-{last}", first, last, option))
    return spans


@pytest.mark.parametrize("seed", range(40))
def test_the_program_with_spans_matches_exhaustive_search(seed: int) -> None:
    rng = random.Random(1000 + seed)
    blocks = _random_blocks(rng, rng.randint(2, 6))
    spans = _random_spans(rng, blocks)
    base = rng.randint(0, 200)
    everything = predict(blocks, [b.options[0] for b in blocks], base)[0]
    budget = rng.randint(base, everything + 10)
    exact = choose_exhaustively(blocks, base, budget, spans)
    found = choose(blocks, base, budget, resolution=4096, spans=spans)
    if exact is None or found is None:
        assert found is None or exact is not None
        if found is None and exact is not None:  # within one grid step per block
            assert exact.peak > budget - len(blocks) * max(1, (budget - base) // 4096)
        return
    assert found.peak <= budget and found.peak == predict(blocks, found.options, base)[0]
    assert found.time <= exact.time * 1.03 + 1e-9
    for span in found.spans:  # a chosen span's blocks carry its strategy, its price once
        members = found.options[span.first : span.last + 1]
        assert members[0] == span.option
        assert all(o.strategy == "stage" and o.kept == o.time == 0 for o in members[1:])


def test_spans_must_cover_two_blocks() -> None:
    blocks = [Block("a", (Option("keep", 10, 0, 0.0),))] * 2
    with pytest.raises(ValueError, match="span 'x' covers blocks 1..1"):
        choose(blocks, 0, 100, spans=[StageOption("x", 1, 1, Option("stage", 1, 1, 0.1))])


def test_the_program_says_when_nothing_fits() -> None:
    blocks = [Block("a", (Option("keep", 10, 0, 0.0), Option("full", 5, 5, 1.0)))]
    assert choose(blocks, base=100, budget=99) is None
    assert choose(blocks, base=0, budget=9) is None
    assert choose(blocks, base=0, budget=10) is not None


def _six_blocks() -> TinyViT:
    torch.manual_seed(0)
    return TinyViT(img=32, depth=6)


def _x(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 32, 32)


def _peak(model: torch.nn.Module, x: torch.Tensor) -> int:
    model.zero_grad(set_to_none=True)
    with track_peak_memory(model, x) as mem:
        default_loss(model(x)).backward()
    model.zero_grad(set_to_none=True)
    return mem.peak_bytes


CONFIG = CheckpointConfig(
    rules=[
        {"match": "blocks.*", "level": 1, "keep": "heavy"},
        {"match": "blocks.*.mlp", "level": 2},
        {"match": "blocks.*", "level": 3},
    ]
)


def _budget(model: torch.nn.Module, share: float) -> int:
    x = _x(8)
    peaks = {}
    for level in (0, 3):
        vision_ckpt.apply(model, CONFIG.model_copy(update={"training_checkpoint_level": level}))
        peaks[level] = _peak(model, x)
        vision_ckpt.remove(model)
    return int(peaks[3] + share * (peaks[0] - peaks[3]))


def test_six_blocks_plan_is_as_fast_as_exhaustive_search_and_fits() -> None:
    model = _six_blocks()
    budget = _budget(model, 0.4)
    result = _per_block(plan_for_budget(model, _x(), budget, batch_size=8, config=CONFIG))
    assert result.config is not None
    assert len(result.candidates) == 6
    menus = [
        Block(
            c["name"],
            tuple(
                Option(s, o["kept"], o["transient"], o["seconds"]) for s, o in c["options"].items()
            ),
        )
        for c in result.candidates
    ]
    assert {s for c in result.candidates for s in c["options"]} == {
        "keep",
        "selective",
        "full",
        "nested",
    }
    goal = int(budget / 1.05)
    assert result.rounds >= 1
    if result.rounds == 1:  # the first answer fitted: no correction of the model's base
        best = choose_exhaustively(menus, result.base_bytes, goal)
        assert best is not None
        planned = result.predicted_time - result.base_time
        assert planned <= best.time * 1.03 + 1e-9
    # the config runs exactly the chosen strategies ...
    plan = vision_ckpt.plan(model, result.config)
    for name, strategy in result.strategies.items():
        entry = next((e for e in plan.entries if e.name == name), None)
        rung = entry.rung_at(int(plan.training_level)) if entry else None
        if strategy == "keep":
            assert rung is None or not entry.checkpointed, name
        else:
            assert entry.checkpointed and rung is not None, name
            assert rung.selective == (strategy == "selective"), name
        mlp = next((e for e in plan.entries if e.name == f"{name}.mlp"), None)
        assert (mlp is not None and mlp.checkpointed) == (strategy == "nested"), name
    # ... and fits the budget at the target batch
    vision_ckpt.apply(model, result.config)
    try:
        assert _peak(model, _x(8)) <= budget
    finally:
        vision_ckpt.remove(model)


@pytest.mark.parametrize(
    ("strategies", "share"),
    [(("selective",), 0.9), (("selective_below",), 0.5), (("full",), 0.05), (("nested",), 0.05)],
)
def test_each_strategy_alone_is_exact(strategies: tuple[str, ...], share: float) -> None:
    model = _six_blocks().train()
    result = plan_for_budget(
        model, _x(), _budget(model, share), batch_size=8, config=CONFIG, strategies=strategies
    )
    result = _per_block(result)
    used = set(result.strategies.values()) - {"keep"}
    assert used <= set(strategies)
    assert result.config is not None, result.explain()
    assert used, result.strategies
    x = _x(4)
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    default_loss(reference(x)).backward()
    vision_ckpt.apply(model, result.config)
    torch.manual_seed(1)
    default_loss(model(x)).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_redoing_cheap_products_is_priced_between_selective_and_full() -> None:
    """NOTE [ Products cheap to redo ]: TinyViT's q @ k^T (16 channels a head) and its 32-wide
    linear layers cost under the break-even per output; its MLP's second layer (128 wide) does
    not. So every block redoing them keeps less than selective and more than full, and its
    recomputation costs more than selective's and less than the whole block's."""
    result = plan_for_budget(
        _six_blocks(),
        _x(),
        "1GiB",
        batch_size=8,
        config=CONFIG,
        strategies=("selective", "selective_below", "full"),
    )
    assert len(result.candidates) == 6
    for block in result.candidates:
        options = block["options"]
        selective, below, full = (options[s] for s in ("selective", "selective_below", "full"))
        assert full["kept"] < below["kept"] < selective["kept"], block["name"]
        assert selective["seconds"] < below["seconds"] < full["seconds"], block["name"]


def _resnet18() -> torch.nn.Module:
    import timm

    torch.manual_seed(0)
    return timm.create_model("resnet18", pretrained=False, num_classes=10).train()


def test_candidates_are_the_blocks_whole_from_level_2_and_3() -> None:
    """timm's resnet preset makes layer1's blocks whole from level 2, layer2's from level 3 and
    the later ones from level 4: all of them are the planner's blocks (with the stem run), not
    the stages."""
    model = _resnet18()
    result = plan_for_budget(model, torch.randn(2, 3, 64, 64), "1GiB", batch_size=4)
    blocks = [f"layer{s}.{b}" for s in range(1, 5) for b in range(2)]
    assert [c["name"] for c in result.candidates] == ["conv1", *blocks]


def test_candidates_include_the_blocks_of_stages_a_preset_keeps_selective() -> None:
    """timm's efficientnet preset recomputes whole blocks only in stages 0-1; the later stages
    are selective at every level, yet the planner still chooses per block there."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("test_efficientnet", pretrained=False, num_classes=4).train()
    result = plan_for_budget(model, torch.randn(2, 3, 32, 32), "1GiB", batch_size=2)
    blocks = [f"blocks.{s}.0" for s in range(len(model.blocks))]
    assert [c["name"] for c in result.candidates] == ["conv_stem", *blocks, "bn2"]


def test_a_lean_mlp_is_neither_a_block_nor_a_part_to_nest() -> None:
    """ConvNeXt's preset makes every MLP lean (not a region): the planner's blocks stay the
    ConvNeXt blocks, and without a region inside them they offer no nested strategy."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("test_convnext", pretrained=False, num_classes=4).train()
    result = plan_for_budget(model, torch.randn(2, 3, 32, 32), "1GiB", batch_size=2)
    blocks = [c for c in result.candidates if ".blocks." in c["name"]]
    assert blocks and not any(c["name"].endswith(".mlp") for c in result.candidates)
    assert all(set(c["options"]) == {"keep", "selective", "full"} for c in blocks)


def test_candidates_are_a_maxvit_block_not_its_parts() -> None:
    """A MaxViT block holds two attention parts of one class: it is still one block, unlike a
    stage that holds numbered blocks (ResNet's layer1 from level 4)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("test_maxvit", pretrained=False, img_size=32, num_classes=4)
    result = plan_for_budget(model.train(), torch.randn(2, 3, 32, 32), "1GiB", batch_size=2)
    names = [c["name"] for c in result.candidates]
    assert "stages.0.blocks.0" in names
    assert not any(n.endswith(("attn_block", "attn_grid", ".conv")) for n in names), names


def test_stage_strategy_runs_whole_stages_selective_exactly_and_fits() -> None:
    """A ResNet stage as one selective region also recomputes what its blocks pass each other
    (per-block regions keep it as their inputs): the planner offers it and its plan is exact."""
    model, x = _resnet18(), torch.randn(2, 3, 64, 64)
    target = torch.randn(48, 3, 64, 64)
    stages = {"match": "layer*", "level": 1, "keep": "heavy"}
    peaks = {}
    for level in (0, 1):  # level 1: every stage selective
        vision_ckpt.apply(model, CheckpointConfig(training_checkpoint_level=level, rules=[stages]))
        peaks[level] = _peak(model, target)
        vision_ckpt.remove(model)
    budget = int(peaks[1] + 0.5 * (peaks[0] - peaks[1]))  # (margin 0: the two are 6% apart)
    result = plan_for_budget(model, x, budget, batch_size=48, strategies=("stage",), margin=0)
    result = _per_block(result)
    assert result.config is not None
    assert result.stages and set(result.stages) <= {"layer1", "layer2", "layer3", "layer4"}
    assert [c["name"] for c in result.stage_candidates] == ["layer1", "layer2", "layer3", "layer4"]
    assert "selective stage(s)" in result.explain()
    members = {n for n, s in result.strategies.items() if s == "stage"}
    assert members == {n for n in result.strategies if n.split(".")[0] in result.stages}
    plan = vision_ckpt.plan(model, result.config)
    assert set(plan.checkpointed) == set(result.stages)
    assert all(plan[n].rung_at(int(plan.training_level)).selective for n in result.stages)
    reference = copy.deepcopy(model)
    torch.manual_seed(1)
    default_loss(reference(x)).backward()
    vision_ckpt.apply(model, result.config)
    try:
        torch.manual_seed(1)
        default_loss(model(x)).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
        model.zero_grad(set_to_none=True)
        assert _peak(model, target) <= budget
    finally:
        vision_ckpt.remove(model)


def test_unknown_strategies_and_impossible_budgets_are_reported() -> None:
    model = _six_blocks()
    with pytest.raises(ConfigError, match=r"unknown strategies \['half'\]; allowed: keep, sel"):
        plan_for_budget(model, _x(), "1GiB", config=CONFIG, strategies=["half"])
    result = plan_for_budget(model, _x(), 1000, batch_size=8, config=CONFIG)
    assert result.config is None and result.explain().startswith("no plan fits 1000 B")


def test_resolve_auto_plans_for_the_configs_budget() -> None:
    model = _six_blocks()
    budget = _budget(model, 0.5)
    auto = CONFIG.model_copy(update={"training_checkpoint_level": "auto", "memory_budget": budget})
    with pytest.raises(ConfigError, match="plan it first with vision_ckpt.tune.resolve_auto"):
        vision_ckpt.apply(model, auto)
    planned = resolve_auto(model, _x(), auto, batch_size=8)
    assert planned.training_checkpoint_level == 3 and planned.memory_budget is None
    vision_ckpt.apply(model, planned)
    try:
        assert _peak(model, _x(8)) <= budget
    finally:
        vision_ckpt.remove(model)
    with pytest.raises(ConfigError, match="resolve_auto needs training_checkpoint_level 'auto'"):
        resolve_auto(model, _x(), CONFIG)
    with pytest.raises(ConfigError, match=r"memory_budget 1000: no plan fits"):
        resolve_auto(model, _x(), auto.model_copy(update={"memory_budget": 1000}), batch_size=8)


def test_planner_frontier_trades_time_for_memory() -> None:
    points = planner_frontier(_six_blocks(), _x(8), config=CONFIG, points=6)
    assert len(points) >= 2
    peaks = [p["peak"] for p in points]
    assert peaks == sorted(peaks)
    # a plan that holds more is never predicted slower than one that holds less
    times = [p["time"] for p in points]
    assert all(a >= b - 1e-9 for a, b in zip(times, times[1:], strict=False))


def test_cli_suggest_writes_a_plan_that_loads(tmp_path, capsys) -> None:
    out, report = tmp_path / "plan.yaml", tmp_path / "plan.json"
    code = main(
        [
            "suggest",
            "--model",
            "resnet18",
            "--img-size",
            "64",
            "--batch-size",
            "8",
            "--budget",
            "120MiB",
            "--out",
            str(out),
            "--json",
            str(report),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    assert "fastest for 120.00 MiB at batch 8" in text and "no checkpointing" in text
    assert "plan fits" in text or "(uniform) fits and no per-block plan was faster" in text
    cfg = CheckpointConfig.from_file(out)
    data = json.loads(report.read_text())
    assert data["plan"]["fits"] and CheckpointConfig.model_validate(data["plan"]["config"]) == cfg
    import timm

    model = timm.create_model("resnet18", pretrained=False, num_classes=10)
    vision_ckpt.plan(model, cfg)  # every rule selects a module of the model


def test_cli_profile_frontier(tmp_path, capsys) -> None:
    plot = tmp_path / "f.png"
    code = main(
        [
            "profile",
            "--model",
            "resnet18",
            "--img-size",
            "64",
            "--batch-size",
            "8",
            "--levels",
            "0,3",
            "--steps",
            "1",
            "--frontier",
            "--plot",
            str(plot),
        ]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    assert "per-block plans (predicted)" in text and plot.stat().st_size > 0


# --- never slower than a uniform level (issue 27) ----------------------------------------------


def _check_never_slower(model, x, budget, batch_size, config=None):
    """The answer fits (measured at the target batch) and is predicted no slower than the
    fastest uniform level that fits, on the one scale both are timed on."""
    result = plan_for_budget(model, x, budget, batch_size=batch_size, config=config)
    assert result.config is not None, result.explain()
    fastest = result.fastest_uniform()
    assert fastest is not None and result.uniform[fastest].seconds is not None
    assert result.measurement.seconds <= result.uniform[fastest].seconds, result.uniform
    if result.uniform_level is not None:
        assert result.uniform_level == fastest and result.measurement == result.uniform[fastest]
    for level, u in result.uniform.items():  # every level that fits was timed, no other
        assert (u.seconds is not None) == (u.peak * 1.05 <= budget), level
        assert u.batch == batch_size and u.predicted and u.meter == "bytes"
    target = x.repeat(-(-batch_size // len(x)), 1, 1, 1)[:batch_size].clone()
    vision_ckpt.apply(model, result.config)
    try:
        assert _peak(model, target) <= budget
    finally:
        vision_ckpt.remove(model)
    return result


@pytest.mark.parametrize("share", [0.1, 0.6])
def test_the_answer_is_never_slower_than_the_fastest_fitting_uniform_level(share) -> None:
    model = _six_blocks()
    _check_never_slower(model, _x(), _budget(model, share), 8, config=CONFIG)


def test_a_faster_uniform_level_is_returned_with_the_plan_it_beat(monkeypatch) -> None:
    import vision_ckpt.tune._planner as planner

    model = _six_blocks()
    budget = _budget(model, 0.5)
    fake = {
        level: Measurement(
            peak=budget // 2,
            batch=8,
            meter="bytes",
            seconds=1.0 + level / 10 if level >= 2 else None,
            predicted=True,
        )
        for level in range(6)
    }
    monkeypatch.setattr(planner, "_uniform_levels", lambda *args: fake)
    monkeypatch.setattr(planner, "step_seconds", lambda work, target: 5.0)
    result = plan_for_budget(model, _x(), budget, batch_size=8, config=CONFIG)
    assert result.uniform_level == 2 and result.config.training_checkpoint_level == 2
    assert result.config.rules == CONFIG.rules  # the user's config, at that level
    assert result.measurement.seconds == 1.2 and result.per_block.measurement.seconds == 5.0
    assert result.per_block.strategies and result.per_block.uniform_level is None
    assert result.explain().startswith("level 2 (uniform) fits and no per-block plan was faster")
    assert set(result.blocks) == set(vision_ckpt.plan(model, result.config).checkpointed)
    # a per-block plan as fast as the fastest level is kept (a tie goes to the plan)
    monkeypatch.setattr(planner, "step_seconds", lambda work, target: 1.2)
    result = plan_for_budget(model, _x(), budget, batch_size=8, config=CONFIG)
    assert result.uniform_level is None and result.strategies
    assert result.measurement.seconds == 1.2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "vit_small_patch16_224", "convnext_tiny"])
def test_never_slower_than_a_uniform_level_at_batch_32(name) -> None:
    """The issue's done-when: budgets between level 0's peak and the top level's, batch 32."""
    import timm

    model = timm.create_model(name, pretrained=False)
    x = torch.randn(4, 3, 224, 224)
    suggestion = vision_ckpt.tune.suggest_level(model, x, "1TiB", batch_size=32)
    peaks = {level: m.peak for level, m in suggestion.predicted.items()}
    low, high = min(peaks.values()), peaks[0]
    for share in (0.2, 0.5, 0.8):
        _check_never_slower(model, x, int((low + share * (high - low)) * 1.05), 32)


class _Expand(torch.nn.Module):
    """An inverted-residual-like block: a widening conv, BN, ReLU, then a narrowing conv, BN,
    ReLU, called one after another (two runs of sibling calls inside one block)."""

    def __init__(self, c: int = 4, wide: int = 32) -> None:
        super().__init__()
        self.conv1, self.bn1, self.act1 = (
            torch.nn.Conv2d(c, wide, 1),
            torch.nn.BatchNorm2d(wide),
            torch.nn.ReLU(),
        )
        self.conv2, self.bn2, self.act2 = (
            torch.nn.Conv2d(wide, c, 1),
            torch.nn.BatchNorm2d(c),
            torch.nn.ReLU(),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act2(self.bn2(self.conv2(self.act1(self.bn1(self.conv1(x))))))


def test_a_nested_block_recomputes_its_inner_runs_as_runs() -> None:
    """A block's inner regions keep their spans when the planner prices it nested: the run
    conv1..act1 holds only the block's narrow input, so nested brings back far less than full
    (priced with conv1 alone, nested held the wide conv and BN outputs as full does)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[_Expand() for _ in range(3)]).train()
    config = {
        "rules": [
            {"match": "*", "level": 3},
            {"match": "*.conv1", "level": 2, "through": "act1"},
            {"match": "*.conv2", "level": 2, "through": "act2"},
        ]
    }
    result = plan_for_budget(model, torch.randn(2, 4, 16, 16), "1GiB", batch_size=8, config=config)
    for block in result.candidates:
        nested, full = block["options"]["nested"], block["options"]["full"]
        assert nested["kept"] == full["kept"]
        assert nested["transient"] < 0.8 * full["transient"], block
