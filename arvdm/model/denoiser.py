"""The denoiser: a conv U-Net spatial path around spatio-temporal transformer blocks, in pixel space.

Its layers are in arvdm/model/layers.py (transformer) and arvdm/model/unet.py (convolutions), its memory path
(past frames -> prefix tokens / concat vector / cross K/V) in arvdm/model/memory_path.py; this file holds the
model, its forward and the commits of a cached rollout.

    model = Denoiser(cfg)                                    # cfg: arvdm.config.Config
    v = model(x, levels, actions, memory=MemoryFrames(...))  # training / uncached rollout
    state = model.init_state(batch_size)                     # cached rollout
    model.commit(state, frames, their_actions)               # frames leave the window (levels= if noised)
    v = model(x, levels, actions, state=state)

Architecture (v-prediction; every frame has its own noise level):

    cond (B,T,D)  = MLP(sinusoidal(level / K)) + action embedding     (one vector per frame)
    x (B,T,C,H,W) --ConvEncoder--> (model.last_frame_input: + zero-init conv of the most recent past frame,
                                   the memory's last, added to the stem's output of every window frame;
                                   model.action_advection: + zero-init conv of that frame moved along the
                                   window's actions by learned per-action kernels, `unet.ActionAdvection`)
                                   per level: ResBlock with adaptive group norm from cond, stride-2 down
                                   (model.unet_channels; [] = no conv levels, a plain patch DiT)
                  --patchify the lowest feature map--> tokens (B,T,N,D) + learned 2-D position embedding
    depth x Block, each sublayer pre-norm, AdaLN-Zero modulated by the frame's cond:
        spatial attention   within each frame (N tokens, plain SDPA)
        temporal attention  block-causal over frames (kernels.chunked_attention), RoPE on the
                            absolute frame index; "factorized": per spatial position (tokens_per_frame
                            = 1), "full": all tokens of all frames in one sequence (tokens_per_frame = N)
        cross attention     only for memory.structure = cross_attention: window tokens -> memory tokens
        MLP
    final AdaLN + linear --unpatchify--> ConvDecoder (skips from the encoder, ResBlocks, upsampling,
    zero-init output conv, so training starts from v = 0) --> v (B,T,C,H,W)
    (model.copy_gate: one more output channel, a gate (per pixel, or its mean per frame) whose clean frame is the
     last past frame's; the v returned gives x0 = x̂0 + g (last − x̂0), see `copy_gate.copy_last`; copy_gate=observed
     gates only while the last frame is a real one, and tells the network which of the two it is)

The transformer blocks run where a frame is a few dozen tokens (8x8 for the tiny preset), as in Diffusion
Forcing's 3-D U-Net; that is where the chunked temporal attention, the memory and the KV caches live. The
convolutions see one frame at a time, so chunked causality and "cached == recomputed" hold unchanged.

Memory (memory.structure), from m raw frames or B compressed latent frames (memory.compressor):
    prepend         memory frames/latents are a prefix of the temporal attention
    channel_concat  memory tokens concatenated along channels -> linear -> added to every window token
    cross_attention an extra AdaLN-gated cross-attention sublayer per block
Memory frames are encoded by the same ConvEncoder at their own level (MemoryFrames.levels; None = 0, clean;
noisy context commits them at a level k_ctx > 0); their skips are not needed.

Cached rollouts (`init_state` / `commit`) keep, per layer, the keys/values of committed frames
(prepend), or the memory projection / cross-attention K/V (the other structures), so a denoising step
costs O(window + memory). See docs/model_and_memory.md for the cache semantics.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
from einops import rearrange

from arvdm.checks import value_checks_enabled
from arvdm.config import CHANNEL_CONCAT, CROSS_ATTENTION, FACTORIZED, PREPEND, Config
from arvdm.model import checkpoint, copy_gate, memory_path
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.model.layers import Block, FinalLayer, LevelEmbedding, PoseTags, Rotary
from arvdm.model.memory_path import DenoiserError
from arvdm.model.state import RolloutState
from arvdm.model.unet import ActionAdvection, ConvDecoder, ConvEncoder
from memory import KVCache, MemoryFrames, RetentionPolicy, build_compressor, make_bank, relative_pose

__all__ = ["Denoiser", "DenoiserError", "DenoiserOutput"]

POS_EMBED_INIT_STD = 0.02  # learned 2-D position embedding, initialised small (as in ViT / DiT)


# ------------------------------------------------------------------------------------------------
# the denoiser
# ------------------------------------------------------------------------------------------------


class DenoiserOutput(NamedTuple):
    """`Denoiser.forward(..., return_extras=True)`: v and what the loss supervises besides it.

    Attributes:
        v: (B,T,C,H,W) the v-prediction (the gated one with model.copy_gate).
        gate_logit: model.copy_gate's logit (B,T,1,H,W) pixel / (B,T,1,1,1) frame, offset included; None without the
            gate or without a last frame (train.copy_gate_loss supervises it).
        x0_hat: (B,T,C,H,W) float32 the network's own clean frame before the gate; None when gate_logit is.
        advected: (B,T,C,H,W) float32 model.action_advection's advected last frame; None without advection or
            without a last frame (the loss's reconstruction term for the kernels, train.advection_loss).
    """

    v: torch.Tensor
    gate_logit: torch.Tensor | None
    x0_hat: torch.Tensor | None
    advected: torch.Tensor | None


class Denoiser(nn.Module):
    """Spatio-temporal DiT predicting v for a window of frames at per-frame noise levels.

    Args:
        cfg: the run `Config`; uses `cfg.model`, `cfg.memory` and `cfg.diffusion.num_levels` (K).
            A deep copy is kept as `self.cfg` and saved by `save_pretrained`.
    """

    def __init__(self, cfg: Config):
        super().__init__()
        mc, mem = cfg.model, cfg.memory
        mc.validate()
        mem.validate()
        cfg.diffusion.validate()
        self.cfg = Config.from_dict(cfg.to_dict())  # private copy: later edits to cfg do not leak in
        self.num_levels = cfg.diffusion.num_levels
        # memory.structure, resolved once: how the past reaches the network
        self.memory_prefix = mem.structure == PREPEND  # a level-0 prefix of the temporal attention
        self.memory_concat = mem.structure == CHANNEL_CONCAT  # projected and added to every window token
        self.memory_cross = mem.structure == CROSS_ATTENTION  # read by a cross-attention sublayer per block
        self.frames_per_chunk = mc.frames_per_chunk
        self.patch, self.channels, self.image_size = mc.patch_size, mc.channels, mc.image_size
        self.grid = mc.token_grid  # tokens per side at the bottleneck
        self.num_tokens = self.grid ** 2  # N
        d = mc.dim
        self.null_action = mc.num_actions  # extra embedding row: "no action" (latent memory frames)

        # Spatial path: optional conv U-Net levels (model.unet_channels) around the token grid.
        unet = list(mc.unet_channels)
        self.encoder = ConvEncoder(mc.channels, unet, d) if unet else None
        # model.copy_gate: one more output channel, the logit of a gate (per pixel / frame) that copies the last frame
        self.copy_gate, self.gate_per_frame = mc.copy_gate != "off", mc.copy_gate == "frame"
        # copy_gate=observed: the gate only while the last frame is observed; a learned vector added to every window
        # frame's conditioning says it is on, so the ungated network is one trained for generated last frames
        self.gate_on_embed = nn.Parameter(torch.zeros(d)) if mc.copy_gate == "observed" else None
        self.decoder = ConvDecoder(mc.channels + int(self.copy_gate), unet, d) if unet else None
        if self.copy_gate:  # √ᾱ and √(1−ᾱ) per level (K+1,), from the run's noise schedule; not saved
            alphas_bar = PerFrameDiffusion(cfg.diffusion).alphas_bar
            self.register_buffer("sqrt_ab", alphas_bar.sqrt().float(), persistent=False)
            self.register_buffer("sqrt_1m_ab", (1 - alphas_bar).sqrt().float(), persistent=False)
        # model.last_frame_input: the most recent past frame (full resolution) beside every window frame, through
        # its own zero-initialised conv added to the stem's output, so a fresh model computes what it did without
        self.last_frame_stem = nn.Conv2d(mc.channels, unet[0], 3, padding=1) if mc.last_frame_input else None
        if self.last_frame_stem is not None:
            nn.init.zeros_(self.last_frame_stem.weight)
            nn.init.zeros_(self.last_frame_stem.bias)
        # model.action_advection r: the last frame moved along the window's actions (CDNA kernels), a second input
        self.advection = (ActionAdvection(mc.num_actions, mc.action_advection, mc.channels, unet[0])
                          if mc.action_advection else None)
        token_in = unet[-1] if unet else mc.channels  # channels of the map that is patchified
        self.patch_embed = nn.Linear(token_in * mc.patch_size ** 2, d)
        self.pos_embed = nn.Parameter(torch.randn(1, 1, self.num_tokens, d) * POS_EMBED_INIT_STD)  # 2-D grid
        self.level_embed = LevelEmbedding(d, cfg.diffusion.num_levels)
        self.action_embed = nn.Embedding(mc.num_actions + 1, d)
        self.rope = Rotary(d // mc.heads)
        self.blocks = nn.ModuleList(
            Block(d, mc.heads, mc.mlp_ratio, mc.temporal_attention, mc.frames_per_chunk,
                  cross=self.memory_cross) for _ in range(mc.depth))
        self.final = FinalLayer(d, token_in * mc.patch_size ** 2, zero_init=self.decoder is None)

        # memory path
        self.compressor = build_compressor(mem.compressor, dim=d, heads=mc.heads, num_tokens=self.num_tokens,
                                           budget=mem.budget, num_actions=mc.num_actions)
        self.memory_slots = mem.budget if self.compressor is not None else mem.length  # L
        # memory chosen by pose (memory/select.py): each memory frame and window frame is tagged with its pose
        # relative to the window (and its age); the memory is chosen anew for every window
        self.pose_aware = mem.select == "pose"
        if self.pose_aware:
            self.pose_tags = PoseTags(d)
        # raw frames as a prefix: committed frames' K/V are cached per layer (else rebuilt at every commit)
        self.caches_committed_kv = self.memory_prefix and self.compressor is None and not self.pose_aware
        self.tokens_per_frame = 1 if mc.temporal_attention == FACTORIZED else self.num_tokens  # temporal attention
        if self.memory_concat:
            self.memory_proj = nn.Linear(self.memory_slots * d, d)  # (L*D) -> D per spatial position
            nn.init.zeros_(self.memory_proj.weight)  # start as "no memory"; gradients still flow
            nn.init.zeros_(self.memory_proj.bias)
        if self.memory_cross and self.compressor is None:
            # raw memory frames need "how long ago" (latents carry time through the compressor);
            # only built when used, so DDP never sees an unused parameter
            self.memory_age = nn.Sequential(nn.Linear(d, d), nn.SiLU(), nn.Linear(d, d))

    # -- helpers -----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.pos_embed.device

    def num_params(self, trainable_only: bool = False) -> int:
        """Number of parameters (all, or only those with requires_grad)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    def _tags(self, poses: torch.Tensor, target_poses: torch.Tensor, ages: torch.Tensor | None) -> torch.Tensor:
        """Pose (and age) tags (B,T,D) of frames at `poses` (B,T,3) for a window at `target_poses` (B,w,3)."""
        return self.pose_tags(relative_pose(poses.float(), target_poses[:, 0].float()), ages)

    def check_schedule(self, delta, window: int | None = None) -> None:
        """Refuse a schedule this checkpoint cannot serve.

        Args:
            delta: frames finished per AR step (or a schedule object with `.delta` and a window).
            window: window length w.

        Raises:
            DenoiserError: when delta or the window is not a multiple of `model.frames_per_chunk` (the
                grouping of past frames into chunks would shift, and cached K/V would be wrong).
        """
        if window is None:
            sched = delta
            delta = sched.delta
            window = getattr(sched, "window", None)
            if window is None:
                window = sched.matrix.shape[-1]
        c = self.frames_per_chunk
        if delta % c:
            raise DenoiserError(f"schedule delta={delta} is not a multiple of model.frames_per_chunk={c}: a "
                                f"model trained with chunks of {c} frames cannot serve it (use delta in "
                                f"{{{c}, {2 * c}, ...}})")
        if window % c:
            raise DenoiserError(f"schedule window={window} is not a multiple of model.frames_per_chunk={c}")

    def _embed_frames(self, x: torch.Tensor, cond: torch.Tensor, last: torch.Tensor | None = None,
                      advected: torch.Tensor | None = None) -> tuple[torch.Tensor, list | None]:
        """(B,T,C,H,W) frames, (B,T,D) cond -> tokens (B,T,N,D) with the position embedding, and the
        encoder's skips (per level (B*T,c,h,w); None without conv levels). `last` (B,C,H,W): the most recent past
        frame, given to every one of the T frames (model.last_frame_input; None = not available / not used);
        `advected` (B,T,C,H,W): it moved along each frame's actions (model.action_advection)."""
        b, t, p = x.shape[0], x.shape[1], self.patch
        skips = None
        if self.encoder is not None:
            extra = None
            if last is not None:
                e = self.last_frame_stem(last.to(x.dtype))  # (B,c0,H,W)
                extra = e[:, None].expand(b, t, *e.shape[1:]).flatten(0, 1)  # (B*T,c0,H,W)
                if advected is not None:
                    extra = extra + self.advection.stem(advected.flatten(0, 1).to(x.dtype))  # (B*T,c0,H,W)
            f, skips = self.encoder(x.flatten(0, 1), cond.flatten(0, 1), extra)  # (B*T,c,h,w)
            x = f.unflatten(0, (b, t))  # (B,T,c,h,w)
        x = rearrange(x, "b t c (h p1) (w p2) -> b t (h w) (p1 p2 c)", p1=p, p2=p)  # (B,T,N,p*p*c)
        return self.patch_embed(x) + self.pos_embed, skips  # (B,T,N,D)

    def _unpatchify(self, y: torch.Tensor, skips: list | None, cond: torch.Tensor) -> torch.Tensor:
        """Tokens' patch values (B,T,N,p*p*c) -> v (B,T,C,H,W), through the conv decoder if there is one."""
        p, g = self.patch, self.grid
        f = rearrange(y, "b t (h w) (p1 p2 c) -> b t c (h p1) (w p2)", h=g, w=g, p1=p, p2=p)  # (B,T,c,h,w)
        if self.decoder is None:
            return f
        b, t = f.shape[:2]
        return self.decoder(f.flatten(0, 1), skips, cond.flatten(0, 1)).unflatten(0, (b, t))  # (B,T,C,H,W)

    def _last_frame(self, memory: MemoryFrames | None) -> torch.Tensor | None:
        """The last frame (B,C,H,W) of the memory, the most recent past frame (memory banks and training clips
        put the recent frames last), for model.last_frame_input; None when the model does not use it or there is
        no memory (memory dropout, history guidance's memory-free call, an empty bank)."""
        if self.last_frame_stem is None or memory is None or len(memory) == 0:
            return None
        if self.copy_gate and memory.last is not None:  # the gate copies it: clean, not as noisy context has it
            return memory.last
        return memory.frames[:, -1]

    def _cond(self, levels: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return self.level_embed(levels) + self.action_embed(actions)  # (B,T,D)

    def _run(self, h, cond, positions, *, pasts=None, n_prefix=0, prefix_chunk=1, cross_kv=None):
        """Run the blocks; returns tokens (B,T,N,D) and each layer's (K, V) in the kernel layout."""
        cos, sin = self.rope(positions)  # (T,hd) each
        kvs = []
        for i, blk in enumerate(self.blocks):
            h, kv = blk(h, cond, cos, sin, past=None if pasts is None else pasts[i], n_prefix=n_prefix,
                        prefix_chunk=prefix_chunk, cross_kv=None if cross_kv is None else cross_kv[i])
            kvs.append(kv)
        return h, kvs

    # -- input checks ------------------------------------------------------------------------------
    def _check_frames(self, x: torch.Tensor, name: str) -> None:
        want = (self.channels, self.image_size, self.image_size)
        if x.dim() != 5 or tuple(x.shape[2:]) != want:
            raise DenoiserError(f"{name} must be (B, T, {want[0]}, {want[1]}, {want[2]}) for this model, got "
                                f"{tuple(x.shape)}")

    def _check_actions(self, actions: torch.Tensor, shape: tuple[int, int], name: str) -> None:
        if tuple(actions.shape) != shape:
            raise DenoiserError(f"{name} must be (B, T) = {shape}, got {tuple(actions.shape)}")
        if actions.is_floating_point() or actions.dtype == torch.bool:
            raise DenoiserError(f"{name} must be integer (int64), got {actions.dtype}")
        # value checks read the tensor back to the host: CPU / debug only (arvdm.checks)
        if actions.numel() and value_checks_enabled(actions) and (int(actions.min()) < 0
                                                                   or int(actions.max()) >= self.null_action):
            raise DenoiserError(f"{name} must be in 0..{self.null_action - 1} (model.num_actions="
                                f"{self.null_action}), got {int(actions.min())}..{int(actions.max())}")

    def _check_window(self, x, levels, actions) -> None:
        self._check_frames(x, "x")
        b, t = x.shape[:2]
        if t % self.frames_per_chunk:
            raise DenoiserError(f"window of {t} frames is not a multiple of model.frames_per_chunk="
                                f"{self.frames_per_chunk}")
        if tuple(levels.shape) != (b, t) or levels.is_floating_point():
            raise DenoiserError(f"levels must be integer (B, T) = {(b, t)}, got {tuple(levels.shape)} "
                                f"{levels.dtype}")
        if value_checks_enabled(levels) and (int(levels.min()) < 0 or int(levels.max()) > self.num_levels):
            raise DenoiserError(f"levels must be in 0..{self.num_levels} (diffusion.num_levels), got "
                                f"{int(levels.min())}..{int(levels.max())}")
        self._check_actions(actions, (b, t), "actions")

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, levels: torch.Tensor, actions: torch.Tensor,
                memory: MemoryFrames | None = None, state: RolloutState | None = None, return_extras: bool = False,
                drop_actions: torch.Tensor | None = None) -> torch.Tensor | DenoiserOutput:
        """Predict v for a window.

        Args:
            x: (B,T,C,H,W) noisy window; T a multiple of `model.frames_per_chunk`.
            levels: (B,T) int64 per-frame noise levels in 0..K.
            actions: (B,T) int64.
            memory: explicit past frames (training, uncached rollout); the model uses exactly what it is
                given (retention is the bank's job). Their positions fix where the window starts.
            state: a `RolloutState` (cached rollout); the window starts at `state.n_committed`.
            return_extras: return a :class:`DenoiserOutput` (v and what the loss supervises besides it) instead of v.
            drop_actions: (B,) bool: those samples' window actions become the null action (action guidance's
                unconditional branch; train.action_dropout), in the embedding and the advection alike.

        Returns:
            (B,T,C,H,W) v-prediction for the window only, or with `return_extras` a :class:`DenoiserOutput`.
        """
        self._check_window(x, levels, actions)
        if memory is not None and state is not None:
            raise DenoiserError("give either memory= (explicit frames) or state= (cached rollout), not both")
        b, t = x.shape[:2]
        if drop_actions is not None:
            if tuple(drop_actions.shape) != (b,) or drop_actions.dtype != torch.bool:
                raise DenoiserError(f"drop_actions must be (B,) = ({b},) bool, got {tuple(drop_actions.shape)} "
                                    f"{drop_actions.dtype}")
            actions = torch.where(drop_actions[:, None], self.null_action, actions)  # (B,T)
        cond = self._cond(levels, actions)  # (B,T,D)
        last = state.last_frame if state is not None else self._last_frame(memory)  # (B,C,H,W) or None
        cond, gate_on = copy_gate.gate_on(self, cond, state, memory, last)  # (B,T,D); (B,) with copy_gate=observed
        advected = self.advection(last, actions) if self.advection is not None and last is not None else None
        h, skips = self._embed_frames(x, cond, last, advected)  # (B,T,N,D)
        target_poses = state.target_poses if state is not None else memory.target_poses if memory else None
        if self.pose_aware and target_poses is not None:
            if target_poses.shape[:2] != (b, t):
                raise DenoiserError(f"target_poses must be (B, T, 3) = {(b, t, 3)} for this window, got "
                                    f"{tuple(target_poses.shape)}")
            h = h + self._tags(target_poses, target_poses, None)[:, :, None]  # (B,T,N,D)
        win_cond = cond
        n_prefix, prefix_chunk, pasts, cross_kv = 0, 1, None, None

        if state is not None:
            if state.batch_size != b:
                raise DenoiserError(f"state was made for batch {state.batch_size}, the window has batch {b}")
            pos = state.n_committed + torch.arange(t, device=x.device)  # (T,)
            if self.memory_prefix:
                pasts = state.caches
            elif self.memory_concat:
                vec = state.memory_vec
                if vec is None:  # nothing committed yet: every slot empty
                    vec = memory_path.concat_vector(self, None, b)
                h = h + vec[:, None]  # (B,T,N,D)
            else:
                cross_kv = state.cross_kv
        else:
            mem = memory_path.memory_tokens(self, memory, b)
            start = memory.window_start if mem is not None else 0
            pos = start + torch.arange(t, device=x.device)  # (T,)
            if self.memory_prefix and mem is not None:
                # memory frames/latents are a level-0 prefix on the time axis
                n_prefix = mem.tokens.shape[1]
                prefix_chunk = n_prefix if mem.latent else self.frames_per_chunk
                h = torch.cat([mem.tokens, h], dim=1)  # (B,L+T,N,D)
                cond = torch.cat([memory_path.prefix_cond(self, mem), cond], dim=1)  # (B,L+T,D)
                pos = torch.cat([mem.positions, pos])  # (L+T,)
            elif self.memory_concat:
                h = h + memory_path.concat_vector(self, mem, b)[:, None]  # (B,T,N,D)
            elif self.memory_cross and mem is not None:
                cross_kv = memory_path.cross_kv(self, mem)

        h, _ = self._run(h, cond, pos, pasts=pasts, n_prefix=n_prefix, prefix_chunk=prefix_chunk,
                         cross_kv=cross_kv)
        h = h[:, n_prefix:]  # the window's tokens only (B,T,N,D)
        out = self._unpatchify(self.final(h, win_cond), skips, win_cond)  # (B,T,C(+1),H,W)
        # with model.action_advection the gate copies each frame's advected last frame (CDNA's compositing mask)
        source = advected if advected is not None else None if last is None else last[:, None]  # (B,T|1,C,H,W)
        v, logit, x0_hat = (copy_gate.copy_last(self, out, x, levels, source, gate_on) if self.copy_gate
                            else (out, None, None))
        return DenoiserOutput(v, logit, x0_hat, advected) if return_extras else v  # v (B,T,C,H,W)

    # -- cached rollout ----------------------------------------------------------------------------
    def init_state(self, batch_size: int, layer_policies: list[RetentionPolicy] | None = None,
                   memory_select: str | None = None) -> RolloutState:
        """A fresh `RolloutState`: empty bank (policy from cfg.memory) and, for prepend, per-layer caches.

        Args:
            batch_size: B of the rollout.
            layer_policies: optional per-layer cache policies (e.g. streaming layers for hybrid
                attention); default: every layer uses the memory retention policy.
            memory_select: how a pose-aware model chooses memory frames (`memory.SELECTIONS`: pose, time, none,
                other); None = pose for a pose-aware model, the retention policy otherwise (`memory.make_bank`).
        """
        policy = RetentionPolicy.from_config(self.cfg.memory)
        caches = []
        if self.memory_prefix:
            tpf = self.tokens_per_frame
            if layer_policies is not None and len(layer_policies) != len(self.blocks):
                raise DenoiserError(f"layer_policies has {len(layer_policies)} entries, the model has "
                                    f"{len(self.blocks)} layers")
            if self.compressor is not None:  # latents are rebuilt at every commit; never evicted
                caches = [KVCache(RetentionPolicy("all"), tpf) for _ in self.blocks]
            else:
                caches = [KVCache(layer_policies[i] if layer_policies else policy, tpf)
                          for i in range(len(self.blocks))]
        return RolloutState(bank=make_bank(self.cfg.memory, memory_select), caches=caches, batch_size=batch_size)

    @torch.no_grad()
    def commit(self, state: RolloutState, frames: torch.Tensor, actions: torch.Tensor,
               poses: torch.Tensor | None = None, target_poses: torch.Tensor | None = None,
               levels: torch.Tensor | None = None, clean: torch.Tensor | None = None, observed: bool = False) -> None:
        """Write frames that left the window into the rollout state.

        Args:
            state: from `init_state`.
            frames: (B,n,C,H,W) frames, clean or noised to `levels`; n a multiple of `model.frames_per_chunk`.
            actions: (B,n) their actions.
            poses: (B,n,3) their poses: required by a pose-aware model (memory.select=pose), else optional.
            target_poses: (B,w,3) poses of the next window's frames (pose-aware models choose its memory by them).
            levels: (B,n) int64 the frames' noise levels in 0..K-1 (noisy context); None = clean (level 0).
            clean: (B,n,C,H,W) the frames before they were noised (model.copy_gate's last frame); None = `frames`.
            observed: the frames are real ones (a rollout's context), not generated (model.copy_gate=observed).

        The frames go to the bank (retention applied). For prepend with raw frames they also run through
        the network at their level, attending to what the cache holds now, and their K/V are appended to
        every layer's cache (then evicted by the layer's policy). For compressed prepend, channel_concat
        and cross_attention the memory representation is rebuilt from the bank, once per commit.
        """
        self._check_frames(frames, "frames")
        b, n = frames.shape[:2]
        if b != state.batch_size:
            raise DenoiserError(f"state was made for batch {state.batch_size}, got frames with batch {b}")
        if n == 0 or n % self.frames_per_chunk:
            raise DenoiserError(f"commit of {n} frames: must be a positive multiple of model.frames_per_chunk="
                                f"{self.frames_per_chunk} (chunks of committed frames must not shift)")
        self._check_actions(actions, (b, n), "actions")
        start = state.n_committed
        if levels is not None:  # checked as memory levels are (shape, dtype, 0..K-1)
            levels = memory_path.memory_levels(self, MemoryFrames(frames, actions, levels=levels), b)  # (B,n)
        if self.caches_committed_kv:
            cond = self._cond(torch.zeros_like(actions) if levels is None else levels, actions)  # (B,n,D)
            h, _ = self._embed_frames(frames, cond)  # (B,n,N,D)
            pos = start + torch.arange(n, device=frames.device)  # (n,)
            _, kvs = self._run(h, cond, pos, pasts=state.caches, n_prefix=n,
                               prefix_chunk=self.frames_per_chunk)
            for cache, (k, v) in zip(state.caches, kvs):
                cache.append(k, v, range(start, start + n))
        state.bank.append(frames, actions, poses, levels, clean, observed)
        state.target_poses = target_poses
        for cache in state.caches:
            cache.evict(state.n_committed)
        self.refresh_memory(state)

    def refresh_memory(self, state: RolloutState) -> None:
        """Rebuild what the next window reads from ``state.bank``: the memory representation (all but raw
        prepend, whose K/V are appended at commit) and ``state.last_frame``. Every commit ends with it; call it
        after changing ``state.bank`` or ``state.target_poses`` yourself (the teacher-forced memory test does)."""
        if self.caches_committed_kv:
            if self.last_frame_stem is not None:
                state.last_frame = self._last_frame(state.bank.memory())
            return
        if self.pose_aware and state.target_poses is None:
            raise DenoiserError("a pose-aware model (memory.select=pose) chooses each window's memory by the "
                                "window's poses: commit(..., target_poses=(B, w, 3))")
        memory = state.bank.memory(state.target_poses)
        state.last_frame = self._last_frame(memory)  # exactly what an uncached call with this memory uses
        mem = memory_path.memory_tokens(self, memory, state.batch_size)
        if self.memory_prefix:
            for cache in state.caches:
                cache.reset()
            if mem is None:
                return
            n_mem = mem.tokens.shape[1]  # memory sees itself (latents: one chunk), never the window
            _, kvs = self._run(mem.tokens, memory_path.prefix_cond(self, mem), mem.positions, n_prefix=n_mem,
                               prefix_chunk=n_mem if mem.latent else self.frames_per_chunk)
            for cache, (k, v) in zip(state.caches, kvs):
                cache.append(k, v, mem.positions.tolist())
        elif self.memory_concat:
            state.memory_vec = memory_path.concat_vector(self, mem, state.batch_size)
        else:
            state.cross_kv = memory_path.cross_kv(self, mem) if mem is not None else None

    # -- checkpoints (the I/O lives in arvdm/model/checkpoint.py) --------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write `model.safetensors` + `config.json` into `directory`, atomically (`checkpoint.save_pretrained`)."""
        return checkpoint.save_pretrained(self, directory)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, map_location: str | torch.device = "cpu") -> Denoiser:
        """Rebuild a model from `save_pretrained`'s folder (`checkpoint.from_pretrained`; safetensors only)."""
        return checkpoint.from_pretrained(cls, directory, map_location)

    def load_weights(self, tensors: dict[str, torch.Tensor], source: str = "state dict") -> None:
        """Load a flat tensor dict strictly (`checkpoint.load_weights`), naming what does not match."""
        checkpoint.load_weights(self, tensors, what=f"weights ({source})")
