use difftx_experiments::mixture::*;
use rand::SeedableRng;

fn corpus() -> String {
    read_corpus(None).unwrap()[..200_000].to_string()
}

/// Is `w` a pair `kv` of `fmt`: key letters directly followed by value digits?
fn is_pair(w: &str, fmt: &PairFormat) -> bool {
    let b = w.as_bytes();
    b.len() == fmt.pair_chars()
        && b[..fmt.key_len].iter().all(|c| c.is_ascii_lowercase())
        && b[fmt.key_len..].iter().all(|c| c.is_ascii_digit())
}

/// Pairs of the default format (one letter, one digit) among the words of `text`.
fn pairs_in(text: &str) -> Vec<&str> {
    text.split([' ', '\n']).filter(|w| is_pair(w, &PairFormat::default())).collect()
}

#[test]
fn composition_follows_the_character_shares_and_is_reproducible() {
    let spec = MixtureSpec {
        text_fraction: 0.4,
        needle_fraction: 0.2,
        recall_fraction: 0.2,
        icl_fraction: 0.2,
        ..Default::default()
    };
    let text = corpus();
    let docs = build_mixture(&spec, &text, 100, 7).unwrap();
    assert_eq!(docs, build_mixture(&spec, &text, 100, 7).unwrap());
    assert_ne!(docs, build_mixture(&spec, &text, 100, 8).unwrap());
    let budgets = mixture_chars(&spec, 100 * spec.doc_chars);
    assert_eq!(budgets, [10240, 5120, 5120, 5120]);
    // Each document is counted with the newline that separates it from the next.
    let chars = |docs: Vec<&String>| docs.iter().map(|d| d.len() + 1).sum::<usize>();
    let icl: Vec<&String> = docs.iter().filter(|d| d.contains(" -> ")).collect();
    // recall documents: a first line of pairs only, then a line querying every key once
    let recall: Vec<&String> = docs
        .iter()
        .filter(|d| {
            let mut lines = d.lines();
            let first = lines.next().unwrap_or("");
            !first.is_empty() && pairs_in(first).len() == first.split(' ').count()
        })
        .collect();
    // A kind stops at the first document that reaches its share: at most one document over.
    for (got, budget) in [(chars(icl), budgets[3]), (chars(recall), budgets[2])] {
        assert!(got >= budget && got <= budget + spec.doc_chars + 1, "{got} characters for a share of {budget}");
    }
    let total: usize = docs.iter().map(|d| d.len() + 1).sum();
    assert!(total >= 25600 && total <= 25600 + 4 * (spec.doc_chars + 1), "{total}");
    for d in &docs {
        assert!(d.is_ascii());
        assert!(d.len() <= spec.doc_chars, "{} > {}: {d}", d.len(), spec.doc_chars);
    }
}

#[test]
fn needle_documents_answer_their_questions() {
    let text = clean_text(&corpus());
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let fmt = PairFormat::default();
    for _ in 0..50 {
        let doc = needle_document(&text, &fmt, 4, 2, 256, &mut rng);
        let mut lines = doc.lines();
        let body = lines.next().unwrap();
        let qs: Vec<&str> = lines.collect();
        assert_eq!(qs.len(), 2, "{doc}");
        assert_eq!(pairs_in(body).len(), 4, "{doc}");
        for q in qs {
            assert!(body.split(' ').any(|w| w == q), "question {q} not answered in {doc}");
        }
    }
}

#[test]
fn needle_rounds_repeat_the_asked_questions_and_fill_the_document() {
    let text = clean_text(&corpus());
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    let fmt = PairFormat::default();
    for r in [1, 3] {
        let doc = needle_parts(&text, &fmt, 5, r, 128, &mut rng);
        assert_eq!(doc.asked.len(), r);
        let full = doc.text_with_rounds(256, &mut rng);
        assert!(full.starts_with(&doc.text()) && full.len() <= 256 && full.len() + 3 * r > 256, "{full}");
        let mut lines = full.lines();
        let body = lines.next().unwrap();
        let qs: Vec<&str> = lines.collect();
        assert_eq!(qs.len() % r, 0, "{full}");
        for round in qs.chunks(r) {
            let mut round = round.to_vec();
            round.sort();
            let mut asked: Vec<String> = doc.asked.iter().map(|(k, v)| format!("{k}{v}")).collect();
            asked.sort();
            assert_eq!(round, asked, "{full}");
        }
        for q in qs {
            assert!(body.split(' ').any(|w| w == q), "question {q} not answered in {full}");
        }
    }
}

#[test]
fn recall_documents_query_every_pair_once() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(2);
    let words = ["to", "be", "or", "not"];
    for &(fmt, n, filler) in
        &[(PairFormat::default(), 8, (0, 0)), (PairFormat { key_len: 2, key_letters: 4, value_digits: 2 }, 12, (1, 3))]
    {
        let doc = recall_document(&words, &fmt, n, filler, &mut rng);
        let text = doc.text();
        let (ctx, queries) = text.split_once('\n').unwrap();
        assert_eq!(doc.queries.len(), n);
        let ctx_pairs: Vec<&str> = ctx.split(' ').filter(|w| is_pair(w, &fmt)).collect();
        assert_eq!(ctx_pairs.len(), n, "{text}");
        let mut asked: Vec<&str> = queries.split(' ').collect();
        let mut given = ctx_pairs.clone();
        asked.sort();
        given.sort();
        assert_eq!(asked, given, "{text}");
        for (p, v) in &doc.queries {
            assert_eq!(v.len(), fmt.value_digits);
            assert_eq!(p.trim_start().len(), fmt.key_len);
        }
        if filler.1 == 0 {
            assert_eq!(ctx.split(' ').count(), n);
        } else {
            assert!(ctx.split(' ').count() >= 2 * n);
        }
        assert!(text.len() <= recall_chars(&fmt, n) + 8 * n * filler.1);
    }
}

#[test]
fn recall_rounds_repeat_every_query_and_fill_the_document() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let fmt = PairFormat::default();
    for n in [1, 3, 8] {
        let doc = recall_document(&[], &fmt, n, (0, 0), &mut rng);
        let text = doc.text_with_rounds(256, &mut rng);
        assert!(text.len() <= 256 && text.starts_with(&doc.text()), "{text}");
        let mut lines = text.lines();
        let mut given: Vec<&str> = lines.next().unwrap().split(' ').collect();
        given.sort();
        let rounds: Vec<&str> = lines.collect();
        let round_chars = 3 * n;
        // as many rounds as fit: one more would not
        assert_eq!(rounds.len(), (256 - (3 * n - 1)) / round_chars, "{text}");
        for r in rounds {
            let mut asked: Vec<&str> = r.split(' ').collect();
            asked.sort();
            assert_eq!(asked, given, "{text}");
        }
    }
    // A round that does not fit leaves the single round of `text()`.
    let doc = recall_document(&[], &fmt, 8, (0, 0), &mut rng);
    assert_eq!(doc.text_with_rounds(10, &mut rng), doc.text());
}

#[test]
fn pair_formats_have_the_stated_key_space_and_chance() {
    let f = PairFormat { key_len: 2, key_letters: 5, value_digits: 2 };
    assert_eq!(f.key_space(), 25);
    assert!((f.chance() - 0.01).abs() < 1e-12);
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    let p = f.pairs(40, &mut rng);
    assert_eq!(p.len(), 25, "capped at the key space");
    assert!(p.iter().all(|(k, v)| k.len() == 2 && k.bytes().all(|c| (b'a'..b'f').contains(&c)) && v.len() == 2));
    assert!(PairFormat { key_len: 0, ..f }.validate().is_err());
    assert!(PairFormat { key_letters: 27, ..f }.validate().is_err());
    assert!(PairFormat { value_digits: 0, ..f }.validate().is_err());
}

#[test]
fn insertion_respects_depth() {
    let hay = "aa bb cc dd ee ff gg hh ii jj";
    let (t, r) = insert_at_depths(hay, &[("X.".into(), 0.0), ("Y.".into(), 1.0), ("Z.".into(), 0.5)]);
    assert!(t.starts_with("X. aa"));
    assert!(t.ends_with("jj Y."));
    assert_eq!(&t[r[2].clone()], "Z.");
    assert_eq!(&t[r[0].clone()], "X.");
    assert!(t.find("Z.").unwrap() > t.find("cc").unwrap() && t.find("Z.").unwrap() < t.find("hh").unwrap());
}

#[test]
fn synthetic_task_classes_are_consistent() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for k in 2..=6 {
        for letters in [0, 1, 2, 30] {
            let task = SyntheticTask::random(k, letters, &mut rng);
            assert_eq!(task.labels.len(), k);
            // every letter belongs to exactly one class; `letters` of them per class (all when 0 or too many)
            let mut seen = std::collections::BTreeSet::new();
            for c in 0..k {
                let group = (0..26u8).filter(|&i| (i as usize * k) / 26 == c).count();
                let expect = if letters == 0 || letters >= group { group } else { letters };
                assert_eq!(task.letters[c].len(), expect, "k={k} letters={letters} class {c}");
                let mut used = std::collections::BTreeSet::new();
                for _ in 0..300 {
                    let x = task.input_of_class(c, &mut rng);
                    assert_eq!(task.class_of(&x), c, "k={k} x={x}");
                    used.insert(x.clone());
                    assert!(seen.insert(x.clone()) || used.contains(&x), "{x} used by two classes");
                }
                assert_eq!(used.len(), expect, "k={k} letters={letters}: every chosen letter is drawn");
            }
        }
    }
    let doc = icl_document(4, 2, 0, &mut rng);
    assert_eq!(doc.lines().count(), 5);
    // with one letter per class a document uses at most two distinct inputs
    let doc = icl_document(12, 2, 1, &mut rng);
    let inputs: std::collections::BTreeSet<&str> = doc.lines().map(|l| &l[..1]).collect();
    assert!(inputs.len() <= 2, "{doc}");
}

#[test]
fn bad_specs_are_rejected() {
    let text = corpus();
    let bad = MixtureSpec {
        text_fraction: 0.0,
        needle_fraction: 0.0,
        recall_fraction: 0.0,
        icl_fraction: 0.0,
        ..Default::default()
    };
    assert!(build_mixture(&bad, &text, 10, 0).unwrap_err().to_string().contains("fractions"));
    let bad = MixtureSpec { needles: (3, 1), ..Default::default() };
    assert!(build_mixture(&bad, &text, 10, 0).is_err());
    assert!(build_mixture(&MixtureSpec::default(), "short", 10, 0).is_err());
    assert!(build_mixture(&MixtureSpec::default(), &text, 0, 0).is_err());
}

#[test]
fn ties_keep_depth_order() {
    let (t, _) = insert_at_depths("", &[("A.".into(), 1.0), ("B.".into(), 0.2), ("C.".into(), 0.0)]);
    assert_eq!(t, "C. B. A.");
}
