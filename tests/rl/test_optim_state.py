"""The policy's Adam moments are allocated when it is built, and the steps that follow
are bit-identical to those of an optimizer that made its state itself."""
import pytest
import torch

from megatron_tlt.optim_state import allocate_adam_state, torch_optimizers


def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(7, 5, generator=g)),
            torch.nn.Parameter(torch.randn(5, generator=g))]


@pytest.mark.parametrize("cls,kw", [(torch.optim.AdamW, {"weight_decay": 0.1}),
                                    (torch.optim.Adam, {}),
                                    (torch.optim.Adam, {"amsgrad": True})])
def test_eager_moments_give_the_lazy_optimizers_steps_exactly(cls, kw):
    lazy_p, eager_p = _params(0), _params(0)
    lazy, eager = cls(lazy_p, lr=1e-2, **kw), cls(eager_p, lr=1e-2, **kw)
    allocated = allocate_adam_state(eager)
    moments = 3 if kw.get("amsgrad") else 2
    assert allocated == moments * 4 * sum(p.numel() for p in eager_p)
    assert allocate_adam_state(eager) == 0  # existing state is kept
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g) for p in lazy_p]
        for ps in (lazy_p, eager_p):
            for p, gr in zip(ps, grads):
                p.grad = gr.clone()
        lazy.step()
        eager.step()
    for a, b in zip(lazy_p, eager_p):
        assert torch.equal(a, b)
    sl, se = lazy.state_dict()["state"], eager.state_dict()["state"]
    assert sl.keys() == se.keys()
    for i in sl:
        assert sl[i].keys() == se[i].keys()
        for k in sl[i]:
            assert sl[i][k].dtype == se[i][k].dtype and torch.equal(sl[i][k], se[i][k]), k


@pytest.fixture(scope="module")
def tiny_policy(smollm2_dir, tmp_path_factory):
    from rl_fixtures import save_tiny_policy

    return save_tiny_policy(tmp_path_factory.mktemp("optim_state") / "policy", smollm2_dir)


@pytest.mark.parametrize("extra", [(), ("model.dtype=bfloat16",), ("train.optimizer=torch",)])
def test_the_policy_holds_its_moments_before_any_step(tiny_policy, single_process_parallel,
                                                      extra):
    """Built, the policy's optimizer (megatron-core's, over bf16 weights' fp32 main
    copies, or torch's AdamW) holds zero moments for every parameter it steps."""
    from megatron_tlt.config import load_config
    from megatron_tlt.launch import setup
    from megatron_tlt.rl.policy import Policy

    cfg = load_config([], [f"model.hf_path={tiny_policy}", "rollout.cpu_kernels=false",
                           *extra])
    s = setup(cfg)
    policy = Policy(s.model, s.arch, cfg.train, total_optimizer_steps=4)
    pairs = torch_optimizers(policy.optimizer)
    assert pairs
    n = 0
    for _, opt in pairs:
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state[p]
                assert p.dtype == torch.float32  # the moments follow the main params
                assert st["exp_avg"].shape == p.shape and not st["exp_avg"].any()
                assert st["exp_avg_sq"].shape == p.shape and float(st["step"]) == 0.0
                n += p.numel()
    assert n == sum(p.numel() for p in s.model.parameters() if p.requires_grad)
    assert policy.optimizer_state_bytes == 2 * 4 * n
