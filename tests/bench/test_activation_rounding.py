import torch

from tokenmill.bench.activation_rounding import round_blocks, rule


def test_blocks_round_to_their_own_grid_and_zeros_stay():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=g)
    x[1, 32:64] = 0
    for levels in (127.0, 32767.0):
        y = round_blocks(x, levels)
        b, yb = x.reshape(-1, 32), y.reshape(-1, 32)
        dx = b.abs().amax(-1, keepdim=True) / levels
        steps = torch.where(dx > 0, yb / torch.where(dx > 0, dx, 1), 0)
        assert torch.allclose(steps, steps.round(), atol=1e-3)  # integers times dx
        assert steps.abs().max() <= levels + 1e-3
        assert ((yb - b).abs() <= dx / 2 + 1e-6).all()  # nearest
        assert torch.equal(y[1, 32:64], torch.zeros(32))
    assert (round_blocks(x, 32767.0) - x).abs().max() < (round_blocks(x, 127.0) - x).abs().max()


def test_mixed_rules_keep_int16_where_a_block_has_an_outlier():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 64, generator=g)
    x[0, 5] = 40.0  # an outlier in row 0's first block
    for name in ("mix6", "row4"):
        y, int8 = rule(name)(x)
        assert int8.flatten().tolist() == [False, True, True, True], name
        assert torch.equal(y[0, :32], round_blocks(x[0, :32], 32767.0))
        assert torch.equal(y[1, 32:], round_blocks(x[1, 32:], 127.0))
    _, flags = rule("int8")(x)
    assert flags.all() and flags.numel() == 4
    y, flags = rule("bf16")(x)
    assert not flags.any() and torch.equal(y, x.bfloat16().float())


def test_the_study_scores_each_rule_on_the_default_model(smollm2_path, capsys):
    """A short run: int16 agrees with float32 (x keeps 16 bits a block), int8 measurably
    does not, and each rule's share of int8 blocks is counted."""
    from tokenmill.bench.activation_rounding import main

    assert main(["--model", smollm2_path, "--tokens", "96", "--window", "48",
                 "--rules", "int16,int8"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.startswith(("int16 ", "int8 "))}
    kl16, kl8 = float(rows["int16"][1]), float(rows["int8"][1])
    assert kl16 < 1e-4 < kl8
    assert rows["int8"][4] == "100.0%" and rows["int16"][4] == "0.0%"
