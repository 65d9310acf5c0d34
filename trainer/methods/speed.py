"""``selection.method=speed``: SPEED-RL's screening before full rollout (Zhang et al. 2025,
"SPEED-RL: Faster Training of Reasoning Models via Online Curriculum Learning", arXiv 2506.09016;
official code Zanette-Labs/speed-rl at 80e47b5, ``verl/trainer/ppo/data_controller.py``).

Each candidate prompt is first rolled out ``n_init = selection.speed.screen_rollouts`` times; a
prompt whose screening rewards are mixed (neither all right nor all wrong: std > 0) is continued
with ``rollout.n - n_init`` more, its screening rollouts kept in the group. As in the official
controller, a continuation runs in the *next* engine call, fused with that call's screening of
new prompts (one call with per-prompt counts), a group trains once complete, a step trains once
its B rows are complete, and what is left (complete groups beyond B, accepted prompts awaiting
their continuation) is carried to the next step, in the checkpoint (:mod:`.fill`). Every engine
call screens ``ceil(selection.fill.factor x rows)`` new prompts (official: 64 for a batch of 16).

With ``selection.speed.prefilter=greso`` the candidates first pass GRESO's skip draw (Zheng et
al. 2025, arXiv 2506.02177; :mod:`.greso`), fed by the screening rewards of every engine: a
prompt whose screening was all right or all wrong in a row is screened less and less often.
"""

from __future__ import annotations

from ..batch import is_mixed  # noqa: F401  (the screening verdict, re-exported)
from . import register
from .base import Method, MethodContext, keep_mixed
from .fill import fill_rule
from .greso import GresoPrompts, greso_filter


@register("speed")
def speed_method(ctx: MethodContext) -> Method:
    prefilter = greso_filter(ctx) if ctx.cfg.selection.speed.prefilter == "greso" else None
    chooser = GresoPrompts(ctx, fill_rule(ctx.cfg, "speed"), prefilter)
    # Every complete group is mixed (its screening part is); rows short of the batch at the
    # round cap hold rejected screenings, which the update skips.
    return Method("speed", ctx, chooser=chooser, collect=chooser.collect, keep=keep_mixed,
                  rank_state=chooser)
