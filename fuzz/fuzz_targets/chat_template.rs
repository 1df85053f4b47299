//! libFuzzer binary of [`turnwise_fuzz::chat_template`] (its docs give the input layout and invariants).

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| turnwise_fuzz::chat_template::run(data));
