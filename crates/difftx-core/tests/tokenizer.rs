use std::fs;
use std::path::{Path, PathBuf};

use difftx_core::tokenizer::{train_bpe, StreamDecoder, Tokenizer, BYTES_MARKER, TOKENIZER_JSON};

const MIXED: &str = "héllo wörld — 世界 🦀 done";

fn stream_all(tok: &Tokenizer, ids: &[u32]) -> (Vec<String>, String) {
    let mut dec = StreamDecoder::new(tok);
    let mut pieces = Vec::new();
    for &id in ids {
        pieces.push(dec.push(id).unwrap());
    }
    pieces.push(dec.finish().unwrap());
    let joined = pieces.concat();
    (pieces, joined)
}

/// A small corpus with repeated words so BPE has merges to learn.
fn write_corpus(dir: &Path) -> PathBuf {
    let mut text = String::new();
    for i in 0..200 {
        text.push_str(&format!(
            "the quick brown fox jumps over the lazy dog {i}\nto be or not to be, that is the question\n"
        ));
    }
    let p = dir.join("corpus.txt");
    fs::write(&p, text).unwrap();
    p
}

fn trained(dir: &Path, vocab: usize) -> Tokenizer {
    let corpus = write_corpus(dir);
    let out = dir.join("tok").join("tokenizer.json");
    train_bpe(&[corpus], vocab, &out).unwrap();
    Tokenizer::from_file(&out).unwrap()
}

#[test]
fn bytes_encode_is_utf8_bytes_and_round_trips() {
    let tok = Tokenizer::bytes();
    assert_eq!(tok.kind(), "bytes");
    assert_eq!(tok.vocab_size(), 256);
    let ids = tok.encode(MIXED).unwrap();
    let expected: Vec<u32> = MIXED.bytes().map(u32::from).collect();
    assert_eq!(ids, expected);
    assert_eq!(tok.decode(&ids).unwrap(), MIXED);
}

#[test]
fn bytes_decode_is_lossy_and_rejects_ids_above_255() {
    let tok = Tokenizer::bytes();
    assert_eq!(tok.decode(&[b'a' as u32, 0xff, b'b' as u32]).unwrap(), "a\u{FFFD}b");
    let err = tok.decode(&[256]).unwrap_err().to_string();
    assert!(err.contains("256"), "{err}");
}

#[test]
fn bytes_stream_decoder_never_splits_a_character() {
    let tok = Tokenizer::bytes();
    let ids = tok.encode(MIXED).unwrap();
    let (pieces, joined) = stream_all(&tok, &ids);
    assert_eq!(joined, MIXED);
    // The crab is 4 bytes: the first three pushes give nothing, the fourth gives it whole.
    let crab = MIXED.find('🦀').unwrap();
    assert_eq!(&pieces[crab..crab + 4], &["", "", "", "🦀"]);
    for p in &pieces {
        assert!(!p.contains('\u{FFFD}'), "broken character in {p:?}");
    }
}

#[test]
fn bytes_stream_decoder_handles_invalid_and_truncated_input() {
    let tok = Tokenizer::bytes();
    // Invalid byte in the middle, then a truncated 3-byte sequence at the end.
    let ids = [b'a' as u32, 0xff, b'b' as u32, 0xe4, 0xb8];
    let (pieces, joined) = stream_all(&tok, &ids);
    assert_eq!(joined, "a\u{FFFD}b\u{FFFD}");
    assert_eq!(pieces[3], "");
    assert_eq!(pieces[4], "");
    assert_eq!(pieces[5], "\u{FFFD}");
    assert!(StreamDecoder::new(&tok).push(300).is_err());
}

#[test]
fn bpe_train_respects_vocab_and_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    let tok = trained(dir.path(), 300);
    assert_eq!(tok.kind(), "hf");
    let v = tok.vocab_size();
    assert!(v > 256 && v <= 300, "vocab size {v}");

    let text = "the quick brown fox: to be or not to be";
    let ids = tok.encode(text).unwrap();
    assert!(ids.len() < text.len(), "BPE should merge: {} ids for {} bytes", ids.len(), text.len());
    assert!(ids.iter().all(|&i| (i as usize) < v));
    assert_eq!(tok.decode(&ids).unwrap(), text);

    // Characters never seen in training still encode (full byte alphabet) and round trip.
    let ids = tok.encode(MIXED).unwrap();
    assert_eq!(tok.decode(&ids).unwrap(), MIXED);
}

#[test]
fn bpe_vocab_caps_merges() {
    let dir = tempfile::tempdir().unwrap();
    let small = trained(dir.path(), 260);
    assert_eq!(small.vocab_size(), 260);
}

#[test]
fn bpe_stream_decoder_matches_full_decode() {
    let dir = tempfile::tempdir().unwrap();
    let tok = trained(dir.path(), 300);
    let text = format!("to be or not {MIXED} the lazy dog");
    let ids = tok.encode(&text).unwrap();
    let (pieces, joined) = stream_all(&tok, &ids);
    assert_eq!(joined, text);
    for p in &pieces {
        assert!(!p.contains('\u{FFFD}'), "broken character in {p:?}");
    }
}

#[test]
fn bpe_train_errors() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = write_corpus(dir.path());
    let out = dir.path().join("t.json");
    let err = train_bpe(std::slice::from_ref(&corpus), 100, &out).unwrap_err().to_string();
    assert!(err.contains("256"), "{err}");
    let missing = dir.path().join("nope.txt");
    let err = train_bpe(&[missing], 300, &out).unwrap_err().to_string();
    assert!(err.contains("nope.txt"), "{err}");
    assert!(train_bpe(&[], 300, &out).is_err());
}

#[test]
fn from_file_on_garbage_or_missing_is_an_error_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("garbage.json");
    fs::write(&bad, "this is not a tokenizer {").unwrap();
    let err = Tokenizer::from_file(&bad).unwrap_err().to_string();
    assert!(err.contains("garbage.json"), "{err}");
    let wrong = dir.path().join("wrong.json");
    fs::write(&wrong, "{\"hello\": 1}").unwrap();
    let err = Tokenizer::from_file(&wrong).unwrap_err().to_string();
    assert!(err.contains("wrong.json"), "{err}");
    let err = Tokenizer::from_file(&dir.path().join("missing.json")).unwrap_err().to_string();
    assert!(err.contains("missing.json"), "{err}");
}

#[test]
fn model_dir_round_trip_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    Tokenizer::bytes().save_to_model_dir(&model).unwrap();
    assert!(model.join(BYTES_MARKER).is_file());
    assert!(!model.join(TOKENIZER_JSON).exists());
    assert_eq!(Tokenizer::from_model_dir(&model).unwrap().kind(), "bytes");
}

#[test]
fn model_dir_round_trip_hf() {
    let dir = tempfile::tempdir().unwrap();
    let tok = trained(dir.path(), 300);
    let model = dir.path().join("model");
    tok.save_to_model_dir(&model).unwrap();
    assert!(model.join(TOKENIZER_JSON).is_file());
    let back = Tokenizer::from_model_dir(&model).unwrap();
    assert_eq!(back.kind(), "hf");
    assert_eq!(back.vocab_size(), tok.vocab_size());
    assert_eq!(back.encode(MIXED).unwrap(), tok.encode(MIXED).unwrap());

    // Saving the byte tokenizer over it replaces the HF one, and the other way round.
    Tokenizer::bytes().save_to_model_dir(&model).unwrap();
    assert_eq!(Tokenizer::from_model_dir(&model).unwrap().kind(), "bytes");
    tok.save_to_model_dir(&model).unwrap();
    assert!(!model.join(BYTES_MARKER).exists());
    assert_eq!(Tokenizer::from_model_dir(&model).unwrap().kind(), "hf");
}

#[test]
fn model_dir_without_tokenizer_is_bytes_and_bad_inputs_error() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(Tokenizer::from_model_dir(dir.path()).unwrap().kind(), "bytes");

    let err = Tokenizer::from_model_dir(&dir.path().join("absent")).unwrap_err().to_string();
    assert!(err.contains("absent"), "{err}");

    fs::write(dir.path().join(BYTES_MARKER), "{\"type\":\"wordpiece\"}").unwrap();
    let err = Tokenizer::from_model_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains(BYTES_MARKER), "{err}");

    fs::write(dir.path().join(TOKENIZER_JSON), "not json").unwrap();
    let err = Tokenizer::from_model_dir(dir.path()).unwrap_err().to_string();
    assert!(err.contains(TOKENIZER_JSON), "{err}");
}
