"""`structgen validate`: run a corpus of JSON Schemas through the engine (in-process or a server), validate
every output, check the compiled grammars against labelled instances, and summarize per subset."""

from structgen.validate.corpus import CorpusError, SchemaCase, load_corpus, stratified
from structgen.validate.labels import LabelCounts, check_labels, grammar_accepts
from structgen.validate.records import SampleRecord, SchemaRecord, read_report
from structgen.validate.summary import SubsetSummary, render, summarize

__all__ = [
    "CorpusError",
    "LabelCounts",
    "SampleRecord",
    "SchemaCase",
    "SchemaRecord",
    "SubsetSummary",
    "check_labels",
    "grammar_accepts",
    "load_corpus",
    "read_report",
    "render",
    "stratified",
    "summarize",
]
