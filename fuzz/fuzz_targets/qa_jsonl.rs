//! libFuzzer binary of [`turnwise_fuzz::qa_jsonl`] (its docs give the input layout and invariants).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| turnwise_fuzz::qa_jsonl::run(data));
