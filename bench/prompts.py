"""The benchmark prompts, shared by the HTTP client runs and the in-process runs.

Plain completion prompts (no chat template) that a greedy SmolLM2 keeps writing past 128 tokens, so a server that
has no ``ignore_eos`` (llama-cpp-python's) still generates the full 128; the harness checks the counts.
"""

SHORT = "The following is a long, detailed story about a lighthouse keeper and her dog.\n\nChapter 1\n\n"

LONG = (
    "The town of Harrow's End sat on a narrow spit of land between a grey sea and a line of low hills. "
    "For two hundred years its people had fished, mended nets, and argued about the weather. The lighthouse "
    "at the end of the harbour wall was older than the church, older than the oldest house, and the keeper who "
    "lived there, a woman named Mara Quill, was said to be older than all of them put together, though she was "
    "only fifty-three. She had a dog called Biscuit, a scruffy brown terrier with one white ear, who followed "
    "her up the hundred and twelve steps every evening when she lit the lamp. One autumn night, when the wind "
    "came howling in from the north and the rain fell sideways, Mara saw a light far out on the water where no "
    "boat should have been. She watched it for an hour, and it did not move. In the morning she walked down to "
    "the harbour to ask the fishermen whether anyone had gone out, but every boat was tied up and every captain "
    "was accounted for. That evening the light came back.\n\nChapter 1\n\n"
)

DOCUMENT = LONG * 4
"""~930 tokens: the prefill scenarios' prompt. Shared-prefix requests put their distinct tail after it."""
