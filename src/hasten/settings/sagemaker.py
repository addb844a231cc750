"""The keys of an Amazon SageMaker launch config (``compute_environment: AMAZON_SAGEMAKER``), one row each: such a file
loads (``SageMakerConfig``), but hasten does not launch on SageMaker, so the rows have no variable, flag or question.

The keys a SageMaker file shares with a local one are the launch table's rows (:mod:`.launch`); where SageMaker's value
differs (its compute environment, its distributed types, all GPUs by default) the row is the launch row with that
difference, so the key itself is declared once.
"""

from __future__ import annotations

import dataclasses

from ..enums import ComputeEnvironment, SageMakerDistributedType, member_values
from . import Section, Setting
from .launch import (
    COMPUTE_ENVIRONMENT,
    DEBUG,
    DISTRIBUTED_TYPE,
    ENABLE_CPU_AFFINITY,
    GPU_IDS,
    MIXED_PRECISION,
    NUM_MACHINES,
    USE_CPU,
)


def _own(key: str, kind: str = "str", default: str | None = None) -> Setting:
    """A key of SageMaker files alone."""
    return Setting(key, kind, env=None, flag=None, default=default)


EC2_INSTANCE_TYPE = _own("ec2_instance_type")
IAM_ROLE_NAME = _own("iam_role_name")
# The keys a SageMaker file must have.
REQUIRED = (EC2_INSTANCE_TYPE, IAM_ROLE_NAME)

SAGEMAKER = Section(
    name="",
    class_name="SageMakerConfig",
    doc="A config for Amazon SageMaker (``compute_environment: AMAZON_SAGEMAKER``): it loads, but hasten does not "
    "launch on SageMaker.",
    rows=(
        dataclasses.replace(COMPUTE_ENVIRONMENT, default=ComputeEnvironment.AMAZON_SAGEMAKER.value),
        dataclasses.replace(DISTRIBUTED_TYPE, choices=tuple(member_values(SageMakerDistributedType))),
        MIXED_PRECISION,
        USE_CPU,
        DEBUG,
        EC2_INSTANCE_TYPE,
        IAM_ROLE_NAME,
        _own("image_uri"),
        _own("profile"),
        _own("region", default="us-east-1"),
        NUM_MACHINES,
        dataclasses.replace(GPU_IDS, default="all"),
        _own("base_job_name"),
        _own("pytorch_version"),
        _own("transformers_version"),
        _own("py_version"),
        _own("sagemaker_inputs_file"),
        _own("sagemaker_metrics_file"),
        _own("additional_args", "any"),
        ENABLE_CPU_AFFINITY,
    ),
)
