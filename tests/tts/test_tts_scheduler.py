"""offload/tts/scheduler.py against reference numbers from diffusers 0.42.1's DPMSolverMultistepScheduler.

The references were computed once with diffusers (``beta_schedule="squaredcos_cap_v2"``,
``prediction_type="v_prediction"``, everything else default: VibeVoice's scheduler) and are hard-coded here, so
these tests need only torch: no diffusers, no transformers, no ComfyUI.
"""
from __future__ import annotations

import ast
import math

import pytest
import torch

import offload.tts.scheduler as ts  # noqa: E402

_PATH = ts.__file__

TIMESTEPS = {
    1: [999],
    3: [999, 666, 333],
    5: [999, 799, 599, 400, 200],
    10: [999, 899, 799, 699, 599, 500, 400, 300, 200, 100],
    20: [999, 949, 899, 849, 799, 749, 699, 649, 599, 549, 500, 450, 400, 350, 300, 250, 200, 150, 100, 50],
}
SIGMAS_10 = [20291.302734375, 6.3645920753479, 3.103729724884033, 1.980697512626648, 1.3907514810562134,
             1.0155508518218994, 0.7402812242507935, 0.5223599076271057, 0.3374606668949127, 0.1710437536239624, 0.0]
ALPHAS_CUMPROD = {0: 0.9999586939811707, 1: 0.9999125599861145, 500: 0.4922850430011749, 998: 2.428766265438753e-06,
                  999: 2.4287349909002387e-09}
STEP1_10 = [-1.5799015760421753, -1.3494577407836914, -1.0891904830932617, -0.8220825791358948, -0.5735073685646057,
            -0.36236372590065, -0.19447475671768188, -0.060553330928087234, 0.060553330928087234, 0.19447475671768188,
            0.36236372590065, 0.5735073685646057, 0.8220825791358948, 1.0891904830932617, 1.3494577407836914,
            1.5799015760421753]
STEP5_10 = [-1.3402807712554932, -1.0276494026184082, -0.8777989745140076, -0.7729756832122803, -0.6917058825492859,
            -0.6197966933250427, -0.5512504577636719, -0.4798128008842468, -0.390825092792511, -0.24455682933330536,
            0.06486992537975311, 0.6425083875656128, 1.0195192098617554, 1.1645478010177612, 1.254875659942627,
            1.3205578327178955]
FINAL_10 = [-1.7081540822982788, -1.554609775543213, -1.3823033571243286, -1.1950883865356445, -0.985148549079895,
            -0.748674213886261, -0.50206458568573, -0.27577412128448486, -0.0916641354560852, 0.03430337458848953,
            0.12221875786781311, 0.253073513507843, 0.3831055760383606, 0.49453234672546387, 0.5940006971359253,
            0.6923311948776245]
FINAL_20 = [-1.591892123222351, -1.3606042861938477, -1.1019811630249023, -0.8461565375328064, -0.6213618516921997,
            -0.4412328898906708, -0.30301958322525024, -0.19373944401741028, -0.09438205510377884,
            0.015291240066289902, 0.15021200478076935, 0.31407174468040466, 0.5003522634506226, 0.7006140947341919,
            0.9091632962226868, 1.1210142374038696]
FINAL_10_BF16 = [-1.7109375, -1.546875, -1.390625, -1.21875, -1.0, -0.734375, -0.484375, -0.27734375, -0.0947265625,
                 0.03515625, 0.12158203125, 0.25390625, 0.3828125, 0.5, 0.6015625, 0.70703125]
FINAL_EPS_5 = [-36289.453125, -29283.533203125, -19000.185546875, -7969.83251953125, 1030.66748046875,
               5921.93701171875, 6069.5625, 2491.79833984375, -2493.55908203125, -6068.72314453125,
               -5921.267578125, -1029.9832763671875, 7968.6123046875, 19000.076171875, 29282.33203125,
               36290.2421875]


def _sample(dtype=torch.float32) -> torch.Tensor:
    return torch.linspace(-1.5, 1.5, 16, dtype=torch.float64).reshape(2, 8).to(torch.float32).to(dtype)


def _model_output(x: torch.Tensor, i: int) -> torch.Tensor:
    return (torch.sin(3.0 * x.float() + 0.7 * i) * 0.8 + 0.1 * x.float()).to(x.dtype)


def _run(sched, steps: int, dtype=torch.float32) -> list[torch.Tensor]:
    sched.set_timesteps(num_inference_steps=steps)
    x = _sample(dtype)
    out = []
    for i, t in enumerate(sched.timesteps):
        x = sched.step(_model_output(x, i), t, x).prev_sample
        out.append(x.clone())
    return out


def _close(actual: torch.Tensor, expected: list[float], rtol: float = 1e-6, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.flatten().double(), torch.tensor(expected, dtype=torch.float64),
                               rtol=rtol, atol=atol)


def test_imports_only_torch_and_stdlib():
    tree = ast.parse(open(_PATH).read())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    assert names <= {"torch", "math", "typing", "dataclasses", "__future__"}, names


@pytest.mark.parametrize("steps", sorted(TIMESTEPS))
def test_timesteps_match_diffusers(steps):
    sched = ts.VibeVoiceDPMSolver()
    sched.set_timesteps(num_inference_steps=steps)
    assert sched.timesteps.dtype == torch.int64
    assert sched.timesteps.tolist() == TIMESTEPS[steps]
    assert sched.num_inference_steps == steps
    assert len(sched.sigmas) == steps + 1 and float(sched.sigmas[-1]) == 0.0


def test_schedule_values_match_diffusers():
    sched = ts.VibeVoiceDPMSolver()
    for index, value in ALPHAS_CUMPROD.items():
        assert math.isclose(float(sched.alphas_cumprod[index]), value, rel_tol=1e-6)
    sched.set_timesteps(10)
    assert sched.sigmas.dtype == torch.float32
    _close(sched.sigmas, SIGMAS_10, rtol=1e-6, atol=0.0)
    # training helpers used by transformers' diffusion loss
    assert sched.alpha_t.shape == (1000,) and sched.sigma_t.shape == (1000,)
    torch.testing.assert_close(sched.alpha_t**2 + sched.sigma_t**2, torch.ones(1000), rtol=0, atol=1e-6)


def test_prev_sample_matches_diffusers_10_steps():
    traj = _run(ts.VibeVoiceDPMSolver(), 10)
    assert len(traj) == 10 and all(x.dtype == torch.float32 and x.shape == (2, 8) for x in traj)
    _close(traj[0], STEP1_10)  # first-order step
    _close(traj[4], STEP5_10)  # second-order multistep
    _close(traj[-1], FINAL_10)  # first-order final step to sigma 0


def test_prev_sample_matches_diffusers_20_steps():
    _close(_run(ts.VibeVoiceDPMSolver(), 20)[-1], FINAL_20)


def test_bfloat16_keeps_dtype_and_matches_diffusers():
    final = _run(ts.VibeVoiceDPMSolver(), 10, torch.bfloat16)[-1]
    assert final.dtype == torch.bfloat16
    _close(final, FINAL_10_BF16, rtol=0, atol=1e-2)  # one bf16 ulp of slack for platform exp/log differences


def test_epsilon_prediction_matches_diffusers():
    sched = ts.VibeVoiceDPMSolver(prediction_type="epsilon")
    _close(_run(sched, 5)[-1], FINAL_EPS_5, rtol=1e-5, atol=1e-2)


def test_final_step_returns_the_data_prediction():
    sched = ts.VibeVoiceDPMSolver()
    sched.set_timesteps(4)
    x = _sample()
    for i, t in enumerate(sched.timesteps[:-1]):
        x = sched.step(_model_output(x, i), t, x).prev_sample
    v = _model_output(x, 3)
    sigma = sched.sigmas[3]
    alpha_t, sigma_t = 1 / (sigma**2 + 1) ** 0.5, sigma / (sigma**2 + 1) ** 0.5
    expected = alpha_t * x - sigma_t * v  # v-prediction -> x0; the last sigma is 0
    out = sched.step(v, sched.timesteps[-1], x).prev_sample
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_set_timesteps_resets_state_and_runs_repeat_bitwise():
    sched = ts.VibeVoiceDPMSolver()
    a = _run(sched, 10)
    b = _run(sched, 10)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert sched.step_index == 10
    sched.set_timesteps(10)
    assert sched.step_index is None and sched.lower_order_nums == 0
    assert sched.model_outputs == [None, None]


def test_interface_used_by_transformers():
    sched = ts.VibeVoiceDPMSolver()
    assert hasattr(sched, "set_timesteps") and hasattr(sched, "step") and hasattr(sched, "timesteps")
    assert bool(sched) and len(sched) == 1000  # generate() does `noise_scheduler or ...`
    with pytest.raises(ValueError):
        sched.step(torch.zeros(1, 4), 999, torch.zeros(1, 4))  # before set_timesteps
    sched.set_timesteps(num_inference_steps=3)
    out = sched.step(torch.zeros(1, 4), sched.timesteps[0], torch.ones(1, 4), return_dict=False)
    assert isinstance(out, tuple) and out[0].shape == (1, 4)
    assert sched.scale_model_input(torch.ones(2)).tolist() == [1.0, 1.0]


def test_add_noise_formula():
    sched = ts.VibeVoiceDPMSolver()
    sched.set_timesteps(10)
    x, noise = torch.ones(3, 4), torch.full((3, 4), 2.0)
    timesteps = sched.timesteps[torch.tensor([0, 4, 9])]
    out = sched.add_noise(x, noise, timesteps)
    sig = torch.tensor([SIGMAS_10[0], SIGMAS_10[4], SIGMAS_10[9]])
    alpha_t = 1 / (sig**2 + 1) ** 0.5
    torch.testing.assert_close(out, (alpha_t + 2 * sig * alpha_t)[:, None].expand(3, 4), rtol=1e-6, atol=1e-6)


def test_config_handling():
    sched = ts.VibeVoiceDPMSolver.from_config({"beta_schedule": "squaredcos_cap_v2", "prediction_type": "v_prediction",
                                               "num_train_timesteps": 1000,
                                               "_class_name": "DPMSolverMultistepScheduler"})
    assert sched.config["solver_order"] == 2 and sched.config["algorithm_type"] == "dpmsolver++"
    alias = ts.VibeVoiceDPMSolver(beta_schedule="cosine")  # the original VibeVoice config's name
    assert torch.equal(alias.alphas_cumprod, sched.alphas_cumprod)
    for bad in ({"algorithm_type": "sde-dpmsolver++"}, {"use_karras_sigmas": True}, {"beta_schedule": "exp"},
                {"solver_order": 3}, {"thresholding": True}, {"no_such_option": 1}):
        with pytest.raises(ValueError):
            ts.VibeVoiceDPMSolver(**bad)

    class _GenConfig:
        noise_scheduler_class = "DPMSolverMultistepScheduler"
        noise_scheduler_config = {"beta_schedule": "squaredcos_cap_v2", "prediction_type": "v_prediction"}

    made = ts.make_vibevoice_scheduler(_GenConfig())
    made.set_timesteps(10)
    assert made.timesteps.tolist() == TIMESTEPS[10]
    assert ts.make_vibevoice_scheduler(None).config["prediction_type"] == "v_prediction"
