"""Tools that read outputs and write no dataset: `inspect`, `status`, `tokenizer` (build/check the
omnimodal tokenizer), `explain` (`plan --explain`). They read files through mmtok.formats only."""
