use std::fs;

use difftx_core::tokenizer::Tokenizer;
use difftx_train::data::{load_texts, TokenDataset};
use rand::rngs::StdRng;
use rand::SeedableRng;

fn err_of<T: std::fmt::Debug>(r: anyhow::Result<T>) -> String {
    r.unwrap_err().to_string()
}

#[test]
fn load_plain_text_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.txt");
    fs::write(&p, "hello\nworld\n").unwrap();
    assert_eq!(load_texts(&p, "text").unwrap(), vec!["hello\nworld\n".to_string()]);
    // Any extension that is not JSON is read as plain text.
    let q = dir.path().join("b.md");
    fs::write(&q, "# title").unwrap();
    assert_eq!(load_texts(&q, "text").unwrap(), vec!["# title".to_string()]);
}

#[test]
fn load_jsonl_field_skipping_blank_lines() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.jsonl");
    fs::write(&p, "{\"text\":\"one\",\"n\":1}\n\n{\"text\":\"two\"}\n").unwrap();
    assert_eq!(load_texts(&p, "text").unwrap(), vec!["one", "two"]);
    let q = dir.path().join("d.json");
    fs::write(&q, "{\"body\":\"x\"}\n{\"body\":\"y\"}").unwrap();
    assert_eq!(load_texts(&q, "body").unwrap(), vec!["x", "y"]);
}

#[test]
fn load_jsonl_errors_name_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bad.jsonl");
    fs::write(&p, "{\"text\":\"ok\"}\nnot json\n").unwrap();
    let e = err_of(load_texts(&p, "text"));
    assert!(e.contains("bad.jsonl:2"), "{e}");

    fs::write(&p, "{\"text\":\"ok\"}\n{\"text\":\"ok\"}\n{\"other\":\"x\"}\n").unwrap();
    let e = err_of(load_texts(&p, "text"));
    assert!(e.contains("bad.jsonl:3") && e.contains("\"text\""), "{e}");

    fs::write(&p, "{\"text\":5}\n").unwrap();
    let e = err_of(load_texts(&p, "text"));
    assert!(e.contains("bad.jsonl:1") && e.contains("not a string"), "{e}");
}

#[test]
fn load_directory_recursive_sorted_txt_only() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    fs::create_dir_all(root.join("sub/deeper")).unwrap();
    fs::write(root.join("b.txt"), "B").unwrap();
    fs::write(root.join("a.txt"), "A").unwrap();
    fs::write(root.join("sub/c.txt"), "C").unwrap();
    fs::write(root.join("sub/deeper/d.txt"), "D").unwrap();
    fs::write(root.join("sub/skip.jsonl"), "{\"text\":\"no\"}").unwrap();
    fs::write(root.join("notes.md"), "no").unwrap();
    fs::write(root.join("empty.txt"), "").unwrap();
    assert_eq!(load_texts(root, "text").unwrap(), vec!["A", "B", "C", "D"]);
}

#[test]
fn load_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.txt");
    let e = err_of(load_texts(&missing, "text"));
    assert!(e.contains("missing.txt") && e.contains("does not exist"), "{e}");

    let empty = dir.path().join("empty.txt");
    fs::write(&empty, "").unwrap();
    let e = err_of(load_texts(&empty, "text"));
    assert!(e.contains("empty.txt") && e.contains("empty"), "{e}");

    let empty_jsonl = dir.path().join("empty.jsonl");
    fs::write(&empty_jsonl, "\n\n").unwrap();
    assert!(err_of(load_texts(&empty_jsonl, "text")).contains("empty.jsonl"));

    let empty_dir = dir.path().join("nothing");
    fs::create_dir(&empty_dir).unwrap();
    let e = err_of(load_texts(&empty_dir, "text"));
    assert!(e.contains("nothing") && e.contains("no .txt"), "{e}");

    let only_empty = dir.path().join("only_empty");
    fs::create_dir(&only_empty).unwrap();
    fs::write(only_empty.join("x.txt"), "").unwrap();
    assert!(err_of(load_texts(&only_empty, "text")).contains("only_empty"));

    let binary = dir.path().join("bin.txt");
    fs::write(&binary, [b'a', 0xff, 0xfe]).unwrap();
    let e = err_of(load_texts(&binary, "text"));
    assert!(e.contains("bin.txt") && e.contains("UTF-8"), "{e}");
}

fn text_of_len(n: usize) -> String {
    (0..n).map(|i| (b'a' + (i % 26) as u8) as char).collect()
}

#[test]
fn build_joins_with_newline_and_splits_tail_as_validation() {
    let tok = Tokenizer::bytes();
    let texts = vec![text_of_len(600), text_of_len(399)];
    let ds = TokenDataset::build(&texts, &tok, 8, 0.1).unwrap();
    // 600 + 1 separator + 399 = 1000 tokens; last 10% is validation.
    assert_eq!(ds.train.len() + ds.val.len(), 1000);
    assert_eq!(ds.val.len(), 100);
    let mut all = ds.train.clone();
    all.extend(&ds.val);
    let expected = tok.encode(&format!("{}\n{}", texts[0], texts[1])).unwrap();
    assert_eq!(all, expected);
    // Deterministic.
    assert_eq!(ds, TokenDataset::build(&texts, &tok, 8, 0.1).unwrap());
}

#[test]
fn build_validation_at_least_one_window_and_train_keeps_one() {
    let tok = Tokenizer::bytes();
    let ds = TokenDataset::build(&[text_of_len(100)], &tok, 16, 0.01).unwrap();
    assert_eq!(ds.val.len(), 17);
    assert_eq!(ds.train.len(), 83);
    // A fraction that would leave training too short still leaves one window.
    let ds = TokenDataset::build(&[text_of_len(40)], &tok, 16, 0.9).unwrap();
    assert_eq!(ds.train.len(), 17);
    assert_eq!(ds.val.len(), 23);
    // Exactly two windows is enough.
    let ds = TokenDataset::build(&[text_of_len(34)], &tok, 16, 0.0).unwrap();
    assert_eq!((ds.train.len(), ds.val.len()), (17, 17));
}

#[test]
fn build_errors() {
    let tok = Tokenizer::bytes();
    let e = err_of(TokenDataset::build(&[text_of_len(33)], &tok, 16, 0.1));
    assert!(e.contains("text shorter than one sequence") && e.contains("33"), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");
    assert!(TokenDataset::build(&[text_of_len(100)], &tok, 0, 0.1).is_err());
    assert!(TokenDataset::build(&[text_of_len(100)], &tok, 8, 1.0).is_err());
    assert!(TokenDataset::build(&[text_of_len(100)], &tok, 8, -0.1).is_err());
    assert!(TokenDataset::build(&[text_of_len(100)], &tok, 8, f64::NAN).is_err());
}

/// A dataset whose token ids are their positions, so windows are easy to check.
fn counting(train: usize, val: usize) -> TokenDataset {
    TokenDataset {
        train: (0..train as u32).collect(),
        val: (0..val as u32).map(|i| 10_000 + i).collect(),
        doc_starts: Vec::new(),
    }
}

#[test]
fn train_batches_are_shifted_windows_and_reproducible() {
    let ds = counting(500, 50);
    let (batch, seq) = (6, 12);
    let (x, y) = ds.sample_train_batch(batch, seq, &mut StdRng::seed_from_u64(7));
    assert_eq!((x.len(), y.len()), (batch * seq, batch * seq));
    for r in 0..batch {
        let xs = &x[r * seq..(r + 1) * seq];
        let ys = &y[r * seq..(r + 1) * seq];
        for t in 0..seq {
            if t > 0 {
                assert_eq!(xs[t], xs[t - 1] + 1, "contiguous window");
            }
            assert_eq!(ys[t], xs[t] + 1, "target = input shifted by one");
        }
        assert!((ys[seq - 1] as usize) < 500);
    }
    // Same seed, same batch; the rng state carries over between calls.
    let mut a = StdRng::seed_from_u64(7);
    let mut b = StdRng::seed_from_u64(7);
    assert_eq!(ds.sample_train_batch(batch, seq, &mut a), (x.clone(), y.clone()));
    assert_eq!(ds.sample_train_batch(batch, seq, &mut b), (x.clone(), y));
    let next_a = ds.sample_train_batch(batch, seq, &mut a);
    assert_eq!(next_a, ds.sample_train_batch(batch, seq, &mut b));
    assert_ne!(next_a.0, x);
}

#[test]
fn train_batch_covers_both_ends_of_a_tiny_stream() {
    // Only two possible offsets: both should be drawn.
    let ds = counting(6, 0);
    let mut rng = StdRng::seed_from_u64(1);
    let (x, _) = ds.sample_train_batch(64, 4, &mut rng);
    let starts: std::collections::BTreeSet<u32> = x.chunks(4).map(|c| c[0]).collect();
    assert_eq!(starts.into_iter().collect::<Vec<_>>(), vec![0, 1]);
}

#[test]
#[should_panic(expected = "too short")]
fn train_batch_panics_when_stream_shorter_than_window() {
    counting(4, 0).sample_train_batch(1, 4, &mut StdRng::seed_from_u64(0));
}

#[test]
fn val_batches_are_deterministic_non_overlapping_windows() {
    // 26 val tokens, seq 5: windows start at 0,5,10,15,20 -> 5 windows.
    let ds = counting(0, 26);
    let batches = ds.val_batches(2, 5, 100);
    assert_eq!(batches.iter().map(|b| b.2).collect::<Vec<_>>(), vec![2, 2, 1]);
    let mut starts = Vec::new();
    for (x, y, rows) in &batches {
        assert_eq!((x.len(), y.len()), (rows * 5, rows * 5));
        for r in 0..*rows {
            starts.push(x[r * 5] - 10_000);
            for t in 0..5 {
                assert_eq!(y[r * 5 + t], x[r * 5 + t] + 1);
            }
        }
    }
    assert_eq!(starts, vec![0, 5, 10, 15, 20]);
    assert_eq!(batches, ds.val_batches(2, 5, 100));
    // max_batches caps the count.
    assert_eq!(ds.val_batches(2, 5, 1).len(), 1);
    assert_eq!(ds.val_batches(2, 5, 0).len(), 0);
    // Too short for one window: no batches.
    assert!(counting(0, 5).val_batches(2, 5, 10).is_empty());
}

#[test]
fn end_to_end_jsonl_to_batches() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("c.jsonl");
    let lines: Vec<String> = (0..50).map(|i| format!("{{\"text\":\"verse {i} — ünïcode\"}}")).collect();
    fs::write(&p, lines.join("\n")).unwrap();
    let texts = load_texts(&p, "text").unwrap();
    assert_eq!(texts.len(), 50);
    let tok = Tokenizer::bytes();
    let ds = TokenDataset::build(&texts, &tok, 32, 0.2).unwrap();
    let (x, y) = ds.sample_train_batch(3, 32, &mut StdRng::seed_from_u64(3));
    assert_eq!(x.len(), 96);
    assert_eq!(y.len(), 96);
    assert!(!ds.val_batches(4, 32, 2).is_empty());
}

#[test]
fn bundled_corpus_loads_into_a_dataset() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/shakespeare.txt");
    let texts = load_texts(&path, "text").unwrap();
    assert_eq!(texts.len(), 1);
    assert!(texts[0].len() > 5_000_000, "{} bytes", texts[0].len());
    let ds = TokenDataset::build(&texts, &Tokenizer::bytes(), 256, 0.05).unwrap();
    assert_eq!(ds.train.len() + ds.val.len(), texts[0].len());
    assert_eq!(ds.val_batches(8, 256, 4).len(), 4);
}

#[test]
fn document_start_windows_begin_at_documents() {
    use difftx_train::data::WindowStart;
    let tok = Tokenizer::bytes();
    // documents of 5, 12 and 3 bytes, then a long tail document for validation
    let texts: Vec<String> = vec!["aaaaa".into(), "bbbbbbbbbbbb".into(), "ccc".into(), "d".repeat(60)];
    let ds = TokenDataset::build(&texts, &tok, 4, 0.3).unwrap();
    // every 4 tokens inside each document: 0, 4 ("aaaaa"); 6, 10, 14 (12 b's); 19 ("ccc"); 23, ...
    assert_eq!(&ds.doc_starts[..6], &[0, 4, 6, 10, 14, 19]);
    assert!(ds.doc_starts.iter().all(|&s| s + 5 <= ds.train.len()));
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    for _ in 0..20 {
        let (x, y) = ds.sample_batch(3, 4, WindowStart::DocumentStart, &mut rng);
        for (row, yr) in x.chunks(4).zip(y.chunks(4)) {
            let start = (0..ds.train.len()).find(|&s| ds.train[s..s + 4] == *row && ds.doc_starts.contains(&s));
            assert!(start.is_some(), "window {row:?} does not start at a document");
            assert_eq!(&row[1..], &yr[..3]);
        }
    }
    // Anywhere draws exactly what sample_train_batch draws
    let mut a = rand::rngs::StdRng::seed_from_u64(3);
    let mut b = rand::rngs::StdRng::seed_from_u64(3);
    assert_eq!(ds.sample_batch(2, 4, WindowStart::Anywhere, &mut a), ds.sample_train_batch(2, 4, &mut b));
}
