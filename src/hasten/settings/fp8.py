"""The ``fp8_config`` table: the FP8 recipe settings, in the order of the ``hasten launch`` options
(which are named ``--fp8_<...>``). ``override_linear_precision`` travels to the processes as three
variables, ``FP8_OVERRIDE_FPROP``/``DGRAD``/``WGRAD`` (the rows without a config key).

hasten trains fp8 through torchao (backend ``AO``): ``backend``, ``enable_fsdp_float8_all_gather`` and
``pad_inner_dim`` fill ``AORecipeKwargs``/``FP8RecipeKwargs``. The Transformer Engine and MS-AMP rows are kept so
that Accelerate's config files load; a launch or an ``Accelerator`` that would train with those backends is refused."""

from __future__ import annotations

from ..errors import NotSupportedError
from . import Question, Section, Setting
from .values import bool_triple, str_to_bool

FP8_BACKENDS = ("TE", "MSAMP", "AO")
FP8_FORMATS = ("HYBRID", "E4M3", "E5M2")
AMAX_COMPUTE_ALGORITHMS = ("max", "most_recent")
FP8_OPT_LEVELS = ("O1", "O2")

FP8 = Section(
    name="fp8_config",
    class_name="Fp8Section",
    doc="``fp8_config``: FP8 recipe settings.",
    group="FP8 arguments",
    rows=(
        Setting(
            "backend",
            "choice",
            FP8_BACKENDS,
            env="FP8_BACKEND",
            env_help="fp8 backend: ao (torchao; te and msamp are refused)",
            flag="fp8_backend",
            flag_help="FP8 backend: ao (torchao). te and msamp are not supported by hasten.",
            field="backend",
            fallback="AO",
            question=Question("Which FP8 backend do you want to use?", "AO", fixed=True),
        ),
        Setting(
            "use_autocast_during_eval",
            "bool",
            env="FP8_USE_AUTOCAST_DURING_EVAL",
            env_help="keep fp8 autocast in evaluation",
            flag="fp8_use_autocast_during_eval",
            flag_help="Keep FP8 autocast in eval mode.",
            switch=True,
            flag_default=False,
        ),
        Setting(
            "margin",
            "int",
            env="FP8_MARGIN",
            env_help="fp8 scaling margin",
            flag="fp8_margin",
            flag_help="Margin of the scaling factor.",
            flag_default=0,
        ),
        Setting(
            "interval",
            "int",
            env="FP8_INTERVAL",
            env_help="fp8 scaling update interval",
            flag="fp8_interval",
            flag_help="Steps between scaling factor updates.",
            flag_default=1,
        ),
        Setting(
            "fp8_format",
            "choice",
            FP8_FORMATS,
            env_help="fp8 format (HYBRID, E4M3, E5M2)",
            flag_help="FP8 format: HYBRID, E4M3 or E5M2.",
            flag_default="HYBRID",
        ),
        Setting(
            "amax_history_length",
            "int",
            env="FP8_AMAX_HISTORY_LEN",
            env_help="fp8 amax history length",
            flag="fp8_amax_history_len",
            flag_help="Length of the amax history.",
            flag_default=1024,
        ),
        Setting(
            "amax_compute_algorithm",
            "choice",
            AMAX_COMPUTE_ALGORITHMS,
            env="FP8_AMAX_COMPUTE_ALGO",
            env_help="fp8 amax algorithm (max, most_recent)",
            flag="fp8_amax_compute_algo",
            flag_help="Amax algorithm: max or most_recent.",
            flag_default="most_recent",
        ),
        Setting(
            "override_linear_precision",
            "bool3",
            env=None,
            flag="fp8_override_linear_precision",
            flag_help="Higher precision for fprop, dgrad, wgrad, e.g. false,false,true.",
            flag_default=(False, False, False),
            flag_type=bool_triple,
        ),
        Setting(
            "optimization_level",
            "choice",
            FP8_OPT_LEVELS,
            env="FP8_OPT_LEVEL",
            env_help="MS-AMP optimisation level (O1, O2)",
            flag="fp8_opt_level",
            flag_help="MS-AMP optimization level: O1 or O2.",
            flag_default="O2",
        ),
        Setting(
            "enable_fsdp_float8_all_gather",
            "bool",
            env="FP8_ENABLE_FSDP_FLOAT8_ALL_GATHER",
            env_help="all-gather FSDP parameters in fp8",
            flag="fp8_enable_fsdp_float8_all_gather",
            flag_help="All-gather in float8 under FSDP (torchao).",
            flag_default="true",
            flag_type=str_to_bool,
            field="enable_fsdp_float8_all_gather",
            fallback=True,
            question=Question(
                "Under FSDP, all-gather the fp8 layers' weights in float8 (half the bytes of bf16)?",
                True,
                step=1,
                when=("backend", ("AO",)),
            ),
        ),
        Setting(
            "pad_inner_dim",
            "bool",
            env="FP8_PAD_INNER_DIM",
            env_help="pad inner dimensions for fp8 matmuls",
            flag="fp8_pad_inner_dim",
            flag_help="Pad inner dimensions for float8 matmuls (torchao).",
            flag_default="true",
            flag_type=str_to_bool,
            field="pad_inner_dim",
            fallback=True,
            question=Question(
                "Pad matrix dimensions to multiples of 16 for the float8 matmuls?",
                True,
                step=2,
                when=("backend", ("AO",)),
            ),
        ),
        Setting(
            None,
            "bool",
            env="FP8_OVERRIDE_FPROP",
            env_help="Transformer Engine override of the forward precision",
            flag=None,
        ),
        Setting(
            None,
            "bool",
            env="FP8_OVERRIDE_DGRAD",
            env_help="Transformer Engine override of the data-gradient precision",
            flag=None,
        ),
        Setting(
            None,
            "bool",
            env="FP8_OVERRIDE_WGRAD",
            env_help="Transformer Engine override of the weight-gradient precision",
            flag=None,
        ),
    ),
)


def unsupported_backend(backend: str, where: str) -> NotSupportedError:
    """The error for an fp8 backend other than torchao; ``where`` names the setting that chose it."""
    names = {"TE": "Transformer Engine", "MSAMP": "MS-AMP"}
    return NotSupportedError(
        f"{where} selects the fp8 backend {backend!r} ({names.get(backend, backend)}), which is not supported by "
        "hasten. "
        "hasten trains in fp8 through torchao (AO): set the backend to 'AO' (fp8_config.backend: AO, "
        "--fp8_backend ao) or pass AORecipeKwargs() in kwargs_handlers."
    )
