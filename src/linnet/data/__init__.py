"""The data layer: records for fine-tuning (read, tokenize, mask) and corpus documents
for pretraining (`linnet.data.corpus`, which `linnet prepare` reads).

    tok = load_tokenizer(card)                                  # or a directory, or a tokenizers.Tokenizer
    examples = load_examples("train.jsonl", tok, tokens=2048)   # read_records + examples_from_records
    rows = pack(examples, 2048, pad_id=tok.pad_id)              # linnet.packing

Records are prompt/completion pairs (field names configurable; Alpaca's found by
default) or chats (`messages`: a list of {role, content}). A chat learns exactly its
assistant turns and their end-of-turn tokens, found from the token ids of the
conversation rendered prefix by prefix with the chat template.

`linnet.data.readers` is the one reader of JSONL and Parquet files: `read_records` for
fine-tuning, `iter_records` streaming them for a corpus.
"""

from linnet.data.examples import chat_example, examples_from_records, load_examples
from linnet.data.pairs import pairs_from_records, unpaired_from_records
from linnet.data.prompts import encode_prompt, prompts_from_records
from linnet.data.readers import Record, iter_records, read_records
from linnet.data.tokenizer import Tokenizer, character_tokenizer, load_tokenizer

__all__ = [
    "Record",
    "Tokenizer",
    "character_tokenizer",
    "chat_example",
    "encode_prompt",
    "examples_from_records",
    "iter_records",
    "load_examples",
    "load_tokenizer",
    "pairs_from_records",
    "unpaired_from_records",
    "prompts_from_records",
    "read_records",
]
