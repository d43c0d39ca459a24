"""Registered prompt templates: a dataset names one in ``template`` instead of a format string.

`dataset` fills them from a row; `hf` reads their placeholders as the row's text fields.
"""

__all__ = ["PROMPT_TEMPLATES"]

# name -> (template with input, template without input)
PROMPT_TEMPLATES: dict[str, tuple[str, str]] = {
    "alpaca": (
        "Below is an instruction that describes a task, paired with an input that provides "
        "further context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n",
    ),
}
