"""The data flags of a run on the test corpus (a tokenized data path and its tokenizer)."""


def flags(corpus, *data_path, split="98,2,0", tokenizer=None):
    return [
        "--data-path",
        *map(str, data_path),
        "--split",
        split,
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(tokenizer or corpus.tokenizer),
    ]
