"""A pure-torch DPM-Solver++ noise scheduler for VibeVoice's ``generate(noise_scheduler=...)``.

transformers' VibeVoice builds diffusers' ``DPMSolverMultistepScheduler(beta_schedule="squaredcos_cap_v2",
prediction_type="v_prediction")`` when no scheduler is passed, and raises ImportError without diffusers (which ComfyUI
does not ship). ``VibeVoiceDPMSolver`` is that scheduler, re-implemented with torch only, for diffusers' defaults
(``num_train_timesteps=1000``, ``solver_order=2``, ``algorithm_type="dpmsolver++"``, ``solver_type="midpoint"``,
``lower_order_final=True``, ``final_sigmas_type="zero"``, ``timestep_spacing="linspace"``, no thresholding, no
Karras/exponential/beta/flow sigmas): the same operations in the same order and dtypes, so ``prev_sample`` is bitwise
equal to diffusers'. A few other common options (``linear``/``scaled_linear`` betas, ``epsilon``/``sample``
prediction, ``solver_order=1``, ``heun``, ``leading``/``trailing`` spacing) are accepted; anything else raises
``ValueError``.

Interface used by transformers (5.23): ``set_timesteps(num_inference_steps=...)``, ``timesteps``,
``step(model_output, timestep, sample).prev_sample``; for training also ``add_noise``, ``alpha_t``, ``sigma_t``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

__all__ = ["SchedulerOutput", "VibeVoiceDPMSolver", "make_vibevoice_scheduler"]

_SUPPORTED = {
    "beta_schedule": ("squaredcos_cap_v2", "linear", "scaled_linear"),
    "prediction_type": ("v_prediction", "epsilon", "sample"),
    "algorithm_type": ("dpmsolver++",),
    "solver_type": ("midpoint", "heun"),
    "timestep_spacing": ("linspace", "leading", "trailing"),
    "final_sigmas_type": ("zero", "sigma_min"),
}
# Options whose only supported value is diffusers' default (accepted so a diffusers config dict can be passed as is).
_FIXED_DEFAULTS: dict[str, Any] = {
    "trained_betas": None,
    "thresholding": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "use_lu_lambdas": False,
    "use_flow_sigmas": False,
    "variance_type": None,
    "rescale_betas_zero_snr": False,
    "use_dynamic_shifting": False,
    "lambda_min_clipped": -float("inf"),
}
_IGNORED = ("dynamic_thresholding_ratio", "sample_max_value", "flow_shift", "time_shift_type", "_class_name",
            "_diffusers_version")


@dataclass
class SchedulerOutput:
    """Result of ``VibeVoiceDPMSolver.step`` (same field as diffusers' ``SchedulerOutput``)."""

    prev_sample: torch.Tensor


def _cosine_betas(num_train_timesteps: int, max_beta: float = 0.999) -> torch.Tensor:
    """Glide cosine betas (diffusers' ``betas_for_alpha_bar(..., "cosine")``, float64 math, float32 result)."""

    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = []
    for i in range(num_train_timesteps):
        t1 = i / num_train_timesteps
        t2 = (i + 1) / num_train_timesteps
        betas.append(min(1 - alpha_bar(t2) / alpha_bar(t1), max_beta))
    return torch.tensor(betas, dtype=torch.float32)


def _numpy_linspace(start: float, stop: float, num: int) -> torch.Tensor:
    """float64 values equal to ``numpy.linspace(start, stop, num)`` (arange times step, last value set to stop)."""
    if num == 1:
        return torch.tensor([float(start)], dtype=torch.float64)
    step = (float(stop) - float(start)) / (num - 1)
    values = torch.arange(0, num, dtype=torch.float64)
    values = values * step if step != 0 else values / (num - 1) * (float(stop) - float(start))
    values = values + float(start)
    values[-1] = float(stop)
    return values


class VibeVoiceDPMSolver:
    """Multistep DPM-Solver++ (diffusers ``DPMSolverMultistepScheduler`` semantics), torch only."""

    order = 1

    def __init__(
        self,
        num_train_timesteps: int = 1000,
        beta_start: float = 0.0001,
        beta_end: float = 0.02,
        beta_schedule: str = "squaredcos_cap_v2",
        solver_order: int = 2,
        prediction_type: str = "v_prediction",
        algorithm_type: str = "dpmsolver++",
        solver_type: str = "midpoint",
        lower_order_final: bool = True,
        euler_at_final: bool = False,
        final_sigmas_type: str = "zero",
        timestep_spacing: str = "linspace",
        steps_offset: int = 0,
        **kwargs: Any,
    ) -> None:
        """Build the schedule; unknown or unsupported diffusers options raise ``ValueError``."""
        if beta_schedule == "cosine":  # the original VibeVoice config's name for the same schedule
            beta_schedule = "squaredcos_cap_v2"
        values = dict(beta_schedule=beta_schedule, prediction_type=prediction_type, algorithm_type=algorithm_type,
                      solver_type=solver_type, timestep_spacing=timestep_spacing,
                      final_sigmas_type=final_sigmas_type)
        for key, value in values.items():
            if value not in _SUPPORTED[key]:
                raise ValueError(f"VibeVoiceDPMSolver: {key}={value!r} is not supported (use one of {_SUPPORTED[key]})")
        if solver_order not in (1, 2):
            raise ValueError(f"VibeVoiceDPMSolver: solver_order={solver_order!r} is not supported (1 or 2)")
        for key, value in kwargs.items():
            if key in _IGNORED:
                continue
            if key not in _FIXED_DEFAULTS:
                raise ValueError(f"VibeVoiceDPMSolver: unknown option {key!r}")
            default = _FIXED_DEFAULTS[key]
            same = value == default if not (isinstance(default, float) and math.isinf(default)) else (
                value is not None and float(value) == default)
            if not same:
                raise ValueError(f"VibeVoiceDPMSolver: {key}={value!r} is not supported (only {default!r})")

        self.config = dict(
            num_train_timesteps=int(num_train_timesteps), beta_start=beta_start, beta_end=beta_end,
            beta_schedule=beta_schedule, solver_order=int(solver_order), prediction_type=prediction_type,
            algorithm_type=algorithm_type, solver_type=solver_type, lower_order_final=bool(lower_order_final),
            euler_at_final=bool(euler_at_final), final_sigmas_type=final_sigmas_type,
            timestep_spacing=timestep_spacing, steps_offset=int(steps_offset),
        )
        n = self.config["num_train_timesteps"]
        if beta_schedule == "linear":
            self.betas = torch.linspace(beta_start, beta_end, n, dtype=torch.float32)
        elif beta_schedule == "scaled_linear":
            self.betas = torch.linspace(beta_start**0.5, beta_end**0.5, n, dtype=torch.float32) ** 2
        else:
            self.betas = _cosine_betas(n)
        self.alphas = 1.0 - self.betas
        self.alphas_cumprod = torch.cumprod(self.alphas, dim=0)
        self.alpha_t = torch.sqrt(self.alphas_cumprod)
        self.sigma_t = torch.sqrt(1 - self.alphas_cumprod)
        self.lambda_t = torch.log(self.alpha_t) - torch.log(self.sigma_t)
        self.sigmas = ((1 - self.alphas_cumprod) / self.alphas_cumprod) ** 0.5
        self.init_noise_sigma = 1.0
        self.num_inference_steps: Optional[int] = None
        self.timesteps = torch.arange(n - 1, -1, -1, dtype=torch.float32)
        self.model_outputs: list[Optional[torch.Tensor]] = [None] * self.config["solver_order"]
        self.lower_order_nums = 0
        self._step_index: Optional[int] = None
        self._begin_index: Optional[int] = None

    @classmethod
    def from_config(cls, config: Optional[dict] = None, **overrides: Any) -> "VibeVoiceDPMSolver":
        """Build from a diffusers-style config dict (e.g. ``generation_config.noise_scheduler_config``)."""
        merged = dict(config or {})
        merged.update(overrides)
        return cls(**merged)

    def __len__(self) -> int:
        """Number of training timesteps (as diffusers; keeps the object truthy for ``noise_scheduler or ...``)."""
        return self.config["num_train_timesteps"]

    @property
    def step_index(self) -> Optional[int]:
        """Index of the current timestep (``None`` before the first ``step``)."""
        return self._step_index

    @property
    def begin_index(self) -> Optional[int]:
        """First timestep index, when set with ``set_begin_index``."""
        return self._begin_index

    def set_begin_index(self, begin_index: int = 0) -> None:
        """Start the next denoising loop at ``begin_index`` (diffusers' API)."""
        self._begin_index = begin_index

    def set_timesteps(
        self,
        num_inference_steps: Optional[int] = None,
        device: Union[str, torch.device, None] = None,
        timesteps: Optional[list[int]] = None,
        **kwargs: Any,
    ) -> None:
        """Set the ``num_inference_steps`` timesteps (or custom ``timesteps``) and reset the solver state."""
        if kwargs.get("mu") is not None:
            raise ValueError("VibeVoiceDPMSolver: dynamic shifting (mu) is not supported")
        if (num_inference_steps is None) == (timesteps is None):
            raise ValueError("Must pass exactly one of `num_inference_steps` or `timesteps`.")
        n_train = self.config["num_train_timesteps"]
        if timesteps is not None:
            ts = torch.tensor([int(t) for t in timesteps], dtype=torch.int64)
        else:
            num_inference_steps = int(num_inference_steps)
            last_timestep = n_train  # lambda_min_clipped = -inf clips nothing
            spacing = self.config["timestep_spacing"]
            if spacing == "linspace":
                ts = torch.round(_numpy_linspace(0, last_timestep - 1, num_inference_steps + 1))
                ts = ts.flip(0)[:-1].to(torch.int64)
            elif spacing == "leading":
                step_ratio = last_timestep // (num_inference_steps + 1)
                ts = torch.round(torch.arange(0, num_inference_steps + 1, dtype=torch.float64) * step_ratio)
                ts = ts.flip(0)[:-1].to(torch.int64) + self.config["steps_offset"]
            else:  # trailing
                step_ratio = n_train / num_inference_steps
                ts = torch.round(torch.arange(float(last_timestep), 0.0, -step_ratio, dtype=torch.float64))
                ts = ts.to(torch.int64) - 1

        sigmas = (((1 - self.alphas_cumprod) / self.alphas_cumprod) ** 0.5).to(torch.float64)
        sigmas = sigmas[ts]  # numpy.interp at integer timesteps is exact indexing
        if self.config["final_sigmas_type"] == "sigma_min":
            sigma_last = float(((1 - self.alphas_cumprod[0]) / self.alphas_cumprod[0]) ** 0.5)
        else:
            sigma_last = 0.0
        sigmas = torch.cat([sigmas, torch.tensor([sigma_last], dtype=torch.float64)]).to(torch.float32)

        self.sigmas = sigmas
        self.timesteps = ts.to(device=device, dtype=torch.int64)
        self.num_inference_steps = len(ts)
        self.model_outputs = [None] * self.config["solver_order"]
        self.lower_order_nums = 0
        self._step_index = None
        self._begin_index = None

    def _sigma_to_alpha_sigma_t(self, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """VP alpha_t and sigma_t of a sigma (``sigma^2 = (1 - alpha_bar) / alpha_bar``)."""
        alpha_t = 1 / ((sigma**2 + 1) ** 0.5)
        sigma_t = sigma * alpha_t
        return alpha_t, sigma_t

    def convert_model_output(self, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """The data prediction x0 from the model output (DPM-Solver++ works on x0)."""
        prediction_type = self.config["prediction_type"]
        if prediction_type == "sample":
            return model_output
        sigma = self.sigmas[self.step_index]
        alpha_t, sigma_t = self._sigma_to_alpha_sigma_t(sigma)
        if prediction_type == "v_prediction":
            return alpha_t * sample - sigma_t * model_output
        return (sample - sigma_t * model_output) / alpha_t  # epsilon

    def dpm_solver_first_order_update(self, model_output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """First-order DPM-Solver++ step (DDIM)."""
        sigma_t, sigma_s = self.sigmas[self.step_index + 1], self.sigmas[self.step_index]
        alpha_t, sigma_t = self._sigma_to_alpha_sigma_t(sigma_t)
        alpha_s, sigma_s = self._sigma_to_alpha_sigma_t(sigma_s)
        lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
        lambda_s = torch.log(alpha_s) - torch.log(sigma_s)
        h = lambda_t - lambda_s
        return (sigma_t / sigma_s) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * model_output

    def multistep_dpm_solver_second_order_update(
        self, model_output_list: list[torch.Tensor], sample: torch.Tensor
    ) -> torch.Tensor:
        """Second-order multistep DPM-Solver++ step."""
        sigma_t, sigma_s0, sigma_s1 = (
            self.sigmas[self.step_index + 1],
            self.sigmas[self.step_index],
            self.sigmas[self.step_index - 1],
        )
        alpha_t, sigma_t = self._sigma_to_alpha_sigma_t(sigma_t)
        alpha_s0, sigma_s0 = self._sigma_to_alpha_sigma_t(sigma_s0)
        alpha_s1, sigma_s1 = self._sigma_to_alpha_sigma_t(sigma_s1)
        lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
        lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
        lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
        m0, m1 = model_output_list[-1], model_output_list[-2]
        h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
        r0 = h_0 / h
        d0, d1 = m0, (1.0 / r0) * (m0 - m1)
        if self.config["solver_type"] == "midpoint":
            return (
                (sigma_t / sigma_s0) * sample
                - (alpha_t * (torch.exp(-h) - 1.0)) * d0
                - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * d1
            )
        return (  # heun
            (sigma_t / sigma_s0) * sample
            - (alpha_t * (torch.exp(-h) - 1.0)) * d0
            + (alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)) * d1
        )

    def index_for_timestep(self, timestep: Union[int, torch.Tensor],
                           schedule_timesteps: Optional[torch.Tensor] = None) -> int:
        """Index of ``timestep`` in the schedule (the second match when it occurs twice, as diffusers)."""
        if schedule_timesteps is None:
            schedule_timesteps = self.timesteps
        candidates = (schedule_timesteps == timestep).nonzero()
        if len(candidates) == 0:
            return len(self.timesteps) - 1
        if len(candidates) > 1:
            return int(candidates[1].item())
        return int(candidates[0].item())

    def _init_step_index(self, timestep: Union[int, torch.Tensor]) -> None:
        """Set the step index from the first timestep passed to ``step``."""
        if self.begin_index is None:
            if isinstance(timestep, torch.Tensor):
                timestep = timestep.to(self.timesteps.device)
            self._step_index = self.index_for_timestep(timestep)
        else:
            self._step_index = self._begin_index

    def step(
        self,
        model_output: torch.Tensor,
        timestep: Union[int, torch.Tensor],
        sample: torch.Tensor,
        generator: Optional[torch.Generator] = None,
        return_dict: bool = True,
        **kwargs: Any,
    ) -> Union[SchedulerOutput, tuple[torch.Tensor]]:
        """One solver step: returns ``prev_sample`` (the sample at the next, lower, timestep)."""
        if self.num_inference_steps is None:
            raise ValueError(
                "Number of inference steps is 'None', you need to run 'set_timesteps' after creating the scheduler"
            )
        if self.step_index is None:
            self._init_step_index(timestep)
        n = len(self.timesteps)
        lower_order_final = (self.step_index == n - 1) and (
            self.config["euler_at_final"]
            or (self.config["lower_order_final"] and n < 15)
            or self.config["final_sigmas_type"] == "zero"
        )
        model_output = self.convert_model_output(model_output, sample=sample)
        order = self.config["solver_order"]
        for i in range(order - 1):
            self.model_outputs[i] = self.model_outputs[i + 1]
        self.model_outputs[-1] = model_output

        sample = sample.to(torch.float32)  # diffusers upcasts here
        if order == 1 or self.lower_order_nums < 1 or lower_order_final:
            prev_sample = self.dpm_solver_first_order_update(model_output, sample=sample)
        else:
            prev_sample = self.multistep_dpm_solver_second_order_update(self.model_outputs, sample=sample)
        if self.lower_order_nums < order:
            self.lower_order_nums += 1
        prev_sample = prev_sample.to(model_output.dtype)
        self._step_index += 1
        if not return_dict:
            return (prev_sample,)
        return SchedulerOutput(prev_sample=prev_sample)

    def scale_model_input(self, sample: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Identity (DPM-Solver needs no input scaling)."""
        return sample

    def add_noise(self, original_samples: torch.Tensor, noise: torch.Tensor,
                  timesteps: torch.Tensor) -> torch.Tensor:
        """Noise ``original_samples`` to ``timesteps`` of the current schedule (training helper, as diffusers)."""
        sigmas = self.sigmas.to(device=original_samples.device, dtype=original_samples.dtype)
        schedule_timesteps = self.timesteps.to(original_samples.device)
        timesteps = timesteps.to(original_samples.device)
        if self.begin_index is None:
            step_indices = [self.index_for_timestep(t, schedule_timesteps) for t in timesteps]
        elif self.step_index is not None:
            step_indices = [self.step_index] * timesteps.shape[0]
        else:
            step_indices = [self.begin_index] * timesteps.shape[0]
        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < len(original_samples.shape):
            sigma = sigma.unsqueeze(-1)
        alpha_t, sigma_t = self._sigma_to_alpha_sigma_t(sigma)
        return alpha_t * original_samples + sigma_t * noise


def make_vibevoice_scheduler(generation_config: Any = None) -> VibeVoiceDPMSolver:
    """The scheduler a VibeVoice model's generation config asks for (diffusers' default config when it names none)."""
    config = getattr(generation_config, "noise_scheduler_config", None) if generation_config is not None else None
    if config is None:
        config = {"beta_schedule": "squaredcos_cap_v2", "prediction_type": "v_prediction"}
    name = getattr(generation_config, "noise_scheduler_class", None) if generation_config is not None else None
    if name not in (None, "DPMSolverMultistepScheduler"):
        raise ValueError(f"VibeVoiceDPMSolver replaces DPMSolverMultistepScheduler only, not {name!r}")
    return VibeVoiceDPMSolver.from_config(config)
