//! libFuzzer binary of [`turnwise_fuzz::serve_retriever`] (its docs give the input layout and invariants).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| turnwise_fuzz::serve_retriever::run(data));
