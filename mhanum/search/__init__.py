"""Worst-case input search: Hypothesis ``target()`` plus a local optimiser, and a random baseline.

Three kinds of search share one case type and one record format (:mod:`mhanum.search._core`):

* :func:`worst_case` and :func:`random_search` (:mod:`mhanum.search.attention`): one attention
  call against Theorem A.1 (or two schedules against Theorem A.5), with a cheap float64
  objective, Nelder–Mead refinement and a certified confirmation;
* :func:`gradient_worst_case` (:mod:`mhanum.search.gradient`): a backward pass against
  Theorems B.1/B.2;
* :func:`mha_worst_case` (:mod:`mhanum.search.mha`): the whole multi-head attention layer
  against Theorem A.2, drawn or near a real layer;

and :func:`campaign` and :func:`mha_campaign` (:mod:`mhanum.search.campaigns`) run many
searches as tasks of :func:`mhanum.parallel.run_tasks`.
"""

from mhanum.search.attention import OBJECTIVES as OBJECTIVES
from mhanum.search.attention import RANGE_FAMILIES as RANGE_FAMILIES
from mhanum.search.attention import SLACK_LIMIT as SLACK_LIMIT
from mhanum.search.attention import Evaluation as Evaluation
from mhanum.search.attention import Objective as Objective
from mhanum.search.attention import Shape as Shape
from mhanum.search.attention import WorstCase as WorstCase
from mhanum.search.attention import random_search as random_search
from mhanum.search.attention import worst_case as worst_case
from mhanum.search.campaigns import METHODS as METHODS
from mhanum.search.campaigns import campaign as campaign
from mhanum.search.campaigns import campaign_task as campaign_task
from mhanum.search.campaigns import mha_campaign as mha_campaign
from mhanum.search.campaigns import mha_campaign_task as mha_campaign_task
from mhanum.search.gradient import GradientWorstCase as GradientWorstCase
from mhanum.search.gradient import gradient_evaluation as gradient_evaluation
from mhanum.search.gradient import gradient_worst_case as gradient_worst_case
from mhanum.search.mha import NEAR_SENTENCES as NEAR_SENTENCES
from mhanum.search.mha import MHAEvaluation as MHAEvaluation
from mhanum.search.mha import MHAShape as MHAShape
from mhanum.search.mha import MHAWorstCase as MHAWorstCase
from mhanum.search.mha import NearLayer as NearLayer
from mhanum.search.mha import mha_evaluation as mha_evaluation
from mhanum.search.mha import mha_worst_case as mha_worst_case

__all__ = [
    "NEAR_SENTENCES",
    "OBJECTIVES",
    "Evaluation",
    "GradientWorstCase",
    "MHAEvaluation",
    "MHAShape",
    "MHAWorstCase",
    "NearLayer",
    "Objective",
    "Shape",
    "WorstCase",
    "campaign",
    "campaign_task",
    "gradient_evaluation",
    "gradient_worst_case",
    "mha_campaign",
    "mha_campaign_task",
    "mha_evaluation",
    "mha_worst_case",
    "random_search",
    "worst_case",
]
