//! Shared plotting setup: a bundled font (DejaVu Sans, free licence, see assets/) so PNG text
//! renders the same on every machine without system fonts.

use std::sync::Once;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");
static INIT: Once = Once::new();

/// Registers the bundled font as "sans-serif"; call before drawing any text.
pub fn init_fonts() {
    INIT.call_once(|| {
        let _ = plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, FONT);
    });
}

#[cfg(test)]
mod tests {
    use plotters::prelude::*;

    #[test]
    fn draws_a_png_with_text() {
        super::init_fonts();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.png");
        {
            let root = BitMapBackend::new(&path, (200, 100)).into_drawing_area();
            root.fill(&WHITE).unwrap();
            root.draw_text("difftx", &("sans-serif", 20).into_font().color(&BLACK), (10, 10)).unwrap();
            root.present().unwrap();
        }
        assert!(std::fs::metadata(&path).unwrap().len() > 100);
    }
}
