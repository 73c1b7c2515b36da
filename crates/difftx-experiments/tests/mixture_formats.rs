use difftx_experiments::mixture::*;
use rand::SeedableRng;

fn corpus() -> String {
    read_corpus(None).unwrap()[..200_000].to_string()
}

#[test]
fn composition_is_exact_and_reproducible() {
    let spec = MixtureSpec { text_fraction: 0.5, needle_fraction: 0.3, icl_fraction: 0.2, ..Default::default() };
    let text = corpus();
    let docs = build_mixture(&spec, &text, 100, 7).unwrap();
    assert_eq!(docs.len(), 100);
    assert_eq!(docs, build_mixture(&spec, &text, 100, 7).unwrap());
    assert_ne!(docs, build_mixture(&spec, &text, 100, 8).unwrap());
    let needle = docs.iter().filter(|d| d.contains("What is the magic number of")).count();
    let icl = docs.iter().filter(|d| d.contains(" -> ")).count();
    assert_eq!(needle, 30);
    assert_eq!(icl, 20);
    assert_eq!(mixture_counts(&spec, 7), [4, 2, 1]);
    for d in &docs {
        assert!(d.is_ascii());
        assert!(d.len() <= spec.doc_chars, "{} > {}: {d}", d.len(), spec.doc_chars);
    }
}

#[test]
fn needle_documents_answer_their_questions() {
    let text = clean_text(&corpus());
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    for _ in 0..50 {
        let doc = needle_document(&text, 4, 2, 256, &mut rng);
        let qs: Vec<&str> = doc.lines().filter(|l| l.starts_with("What is the magic number of ")).collect();
        assert_eq!(qs.len(), 2, "{doc}");
        for q in qs {
            let key = &q["What is the magic number of ".len().."What is the magic number of ".len() + 3];
            let ans = q.rsplit(' ').next().unwrap();
            assert!(doc.contains(&format!("The magic number of {key} is {ans}.")), "{doc}");
        }
    }
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
        let task = SyntheticTask::random(k, &mut rng);
        assert_eq!(task.labels.len(), k);
        for c in 0..k {
            for _ in 0..20 {
                let x = task.input_of_class(c, &mut rng);
                assert_eq!(task.class_of(&x), c, "k={k} x={x}");
            }
        }
    }
    let doc = icl_document(4, 2, &mut rng);
    assert_eq!(doc.lines().count(), 5);
}

#[test]
fn bad_specs_are_rejected() {
    let text = corpus();
    let bad = MixtureSpec { text_fraction: 0.0, needle_fraction: 0.0, icl_fraction: 0.0, ..Default::default() };
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
