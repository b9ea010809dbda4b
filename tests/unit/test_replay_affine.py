"""memplan.replay.affine: a shape's events at any micro-batch from the line through two traces."""
import dataclasses

from memplan.replay import affine
from memplan.setup import Setup


def _run(b: int) -> list[tuple]:
    # a weight (constant), an activation growing 100 bytes per sample, a workspace growing 8, freed in either order
    return [("w", 4096, "setup"), (7, 100 * b + 12, "forward"), ((7, 2), 8 * b, "forward"),
            *([(7, 0, "backward"), ((7, 2), 0, "backward")] if b % 2 else [((7, 2), 0, "backward"), (7, 0, "backward")]),
            ("never born", 0, "backward"), (9, 64, "optimizer")]


def test_the_line_gives_every_micro_batch():
    line = affine.line_through(_run(2), _run(3))
    assert line is not None and line.base[:3] == (4096, 212, 16) and line.slope[:3] == (0, 100, 8)
    assert set(line.curve) == {0}
    assert all(affine.holds(line, b, _run(b)) for b in (2, 3, 4, 17, 512))
    assert line.upto == 0 and line.events(40) is None  # a line answers only where it was checked
    made = line.events(40, checked=False)
    assert [n for _, n, _ in made] == [4096, 4012, 320, 0, 0, 0, 64]
    # a free of a storage never born is -1 whatever its serial was (the replay skips it); the run of frees in id order
    assert [i for i, n, _ in made if not n] == [-1, 1, 2]


def test_a_free_run_is_compared_in_id_order_not_python_s():
    # the frees of one moment come in no fixed order (_run's odd and even micro-batches differ); a free between
    # births keeps its place
    line = affine.line_through(_run(2), _run(3))
    moved = _run(5)
    moved[3], moved[4] = moved[4], moved[3]
    assert affine.holds(line, 5, moved)
    births_between = _run(5)[:3] + [(7, 0, "forward"), (8, 32, "forward"), ((7, 2), 0, "forward")] + _run(5)[5:]
    assert not affine.holds(line, 5, births_between)


def test_frees_after_the_last_birth_do_not_count():
    # a process's first trace can free more of the model at its end than its second (no peak moves there)
    line = affine.line_through(_run(2) + [("w", 0, "between"), (9, 0, "between")], _run(3))
    assert line is not None and affine.holds(line, 4, _run(4) + [(9, 0, "between")])
    assert len(line.events(4, checked=False)) == len(_run(4))


def test_runs_that_differ_have_no_line():
    grown = _run(3) + [(11, 40, "backward")]  # an event more per sample (TRL's DPO)
    assert affine.line_through(_run(2), grown) is None
    other_phase = [(s, n, "backward" if p == "forward" else p) for s, n, p in _run(3)]
    assert affine.line_through(_run(2), other_phase) is None
    line = affine.line_through(_run(2), _run(3))
    off = _run(6)
    off[1] = (7, 613, "forward")
    assert not affine.holds(line, 6, off)


def _packed(b: int) -> list[tuple]:
    # TRL's packing under sdpa: a [b x 256, b x 256] bool mask beside the [b x 256] tokens
    return [(1, 2048 * b, "forward"), (2, (256 * b) ** 2, "forward"), (2, 0, "forward"), (1, 0, "backward")]


def test_a_mask_over_the_packed_batch_takes_the_curve_through_three_micro_batches():
    assert not affine.holds(affine.line_through(_packed(2), _packed(3)), 5, _packed(5))
    curve = affine.line_through(_packed(2), _packed(3), _packed(4))
    assert curve.curve == (0, 2 * 65536) and all(affine.holds(curve, b, _packed(b)) for b in (5, 9, 64))
    traced: list = []

    def trace(b):
        traced.append(b)
        return _packed(b)
    # the line fails its check at 7; the curve holds there and at the far check, 32, up to which it answers
    got = affine.fit(trace, 7)
    assert got == dataclasses.replace(curve, upto=32) and traced == [2, 3, 7, 4, 32]
    assert got.events(32) is not None and got.events(33) is None and affine.far_check(10) == 40
    traced.clear()
    assert affine.fit(trace, 4).upto == 32 and traced == [2, 3, 4, 5, 32]  # 4 is a base: the curve's check is 5
    traced.clear()
    line = affine.line_through(_run(2), _run(3))
    got = affine.fit(lambda b: traced.append(b) or _run(b), 3)
    assert got == dataclasses.replace(line, upto=32) and traced == [2, 3, 4, 32]


def test_a_line_broken_past_the_asked_micro_batch_is_not_trusted():
    # a kernel that changes path at a token count (AWQ's at 1,024): affine up to 5 samples here, another size past them
    def kinked(b):
        return [(1, 4096 * b if b <= 5 else 999_999, "forward")]
    assert affine.fit(kinked, 4) is None


def test_fit_gives_up_where_the_runs_differ_or_neither_holds():
    traced: list = []
    grows = lambda b: traced.append(b) or [(i, 512, "forward") for i in range(b)]  # noqa: E731
    assert affine.fit(grows, 9) is None and traced == [2, 3]  # no line: no curve either, nothing more traced
    cubic = lambda b: [(1, b ** 3, "forward")]  # noqa: E731
    assert affine.fit(cubic, 9) is None


def test_a_shrinking_size_stops_the_line_where_it_would_not_be_positive():
    line = affine.line_through([(1, 300, "forward")], [(1, 200, "forward")])
    assert line.events(4, checked=False) == [(0, 100, "forward")] and line.events(5, checked=False) is None


def test_the_line_survives_the_cache_and_a_foreign_entry_does_not():
    line = affine.line_through(_run(2), _run(3))
    assert affine.from_json(affine.to_json(line)) == line
    curve = affine.line_through(_packed(2), _packed(3), _packed(4))
    assert affine.from_json(affine.to_json(curve)) == curve
    assert affine.from_json(affine.to_json(None)) is None  # a shape recorded as having no line
    for junk in (None, {}, {"affine": True, "ids": "!!"}, [1, 2], {"affine": True, "phase_names": []}):
        assert affine.from_json(junk) is False


def test_which_setups_take_a_line_and_what_their_shape_is():
    assert affine.applies(Setup(batch_size=2)) and not affine.applies(Setup(batch_size=1))
    assert not affine.applies(Setup(batch_size=4, trainer="dpo", technique="lora"))
    assert not affine.applies(Setup(batch_size=4, mode="infer"))
    assert not affine.applies(Setup(batch_size=4, use_liger_kernel=True))
    assert not affine.applies(Setup(batch_size=4, trainer="sft", activation_offloading=True, grad_ckpt=True))
    a, b = Setup(batch_size=4, grad_accum=8), Setup(batch_size=9, grad_accum=2)
    assert affine.shape_of(a) == affine.shape_of(b) != affine.shape_of(Setup(batch_size=4, grad_accum=1))


def _groups(b: int) -> list[tuple]:
    # GRPO: generations of b completions (b a multiple of 4 when num_generations is 4 and accumulation 1)
    return [(1, 1000 * b, "generation"), (2, 64 * b + 8, "forward"), (1, 0, "forward"), (2, 0, "backward")]


def test_grpo_takes_a_line_over_whole_groups():
    # the micro-batch holds whole groups of num_generations: the shape's micro-batches are multiples of the unit,
    # the bases 2 and 3 units, and a line answers only on them
    four = Setup(trainer="grpo", technique="lora", batch_size=8, num_generations=4, max_completion_length=64)
    assert affine.unit(four) == 4 and affine.applies(four)
    assert not affine.applies(dataclasses.replace(four, batch_size=4))
    assert affine.unit(dataclasses.replace(four, grad_accum=2)) == 2 and affine.unit(Setup(batch_size=3)) == 1
    assert affine.shape_of(four) != affine.shape_of(dataclasses.replace(four, grad_accum=2))  # its generation batch
    traced: list = []
    line = affine.fit(lambda b: traced.append(b) or _groups(b), 20, step=4)
    assert traced == [8, 12, 20, 80] and (line.first, line.step, line.upto) == (8, 4, 80)
    assert line.events(44) == [(0, 44000, "generation"), (1, 2824, "forward")]  # frees past the last birth dropped
    assert line.events(42) is None and line.events(4) is None  # off the groups, before the first base
    assert affine.from_json(affine.to_json(line)) == line


def test_trl_s_head_keeps_a_line_within_one_pass():
    # TRL's fused head runs a pass per 4,096 scored tokens, each with its own events: a line runs up to the last
    # micro-batch of the first pass (GRPO: 16 completions of 256 tokens; SFT: 4 rows of 1,024), no further
    grpo = Setup(trainer="grpo", technique="lora", batch_size=8, seq_len=256, max_completion_length=256,
                 num_generations=4)
    assert affine.head_limit(grpo) == 16 and affine.applies(grpo)
    assert not affine.applies(dataclasses.replace(grpo, batch_size=20))
    assert affine.head_limit(Setup(trainer="sft", batch_size=4, seq_len=1024)) == 4
    assert not affine.applies(Setup(trainer="sft", batch_size=4, seq_len=2048))  # not even the bases in one pass
    assert affine.head_limit(Setup(batch_size=4)) is None
    traced: list = []
    line = affine.fit(lambda b: traced.append(b) or _groups(b), 8, step=4, limit=16)
    assert traced == [8, 12, 16] and line.upto == 16  # the far check stops at the pass's last micro-batch
