//! Does a picture read? Every `<text>` of an SVG written by ferrotron is measured with a stated
//! width per character — 0.7 × the font size, an upper bound on the mean advance of the labels and
//! titles drawn in a sans-serif font (DejaVu Sans: digits 0.64 em, `F` 0.58, `B` 0.69, `.` 0.32) —
//! and from the font size above its baseline to a quarter of it below. No two texts may overlap,
//! every text lies on the canvas, and a label centred in a box (`text-anchor="middle"`, drawn
//! right after its filled `<rect>`) lies inside that box.

const EM: f64 = 0.7;

fn attr(line: &str, name: &str) -> Option<f64> {
    let at = line.find(&format!(" {name}=\""))? + name.len() + 3;
    line[at..].split('"').next()?.parse().ok()
}

struct Text {
    text: String,
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
}

/// The problems found, at most 10 of them named; empty when the picture reads.
pub fn problems(svg: &str) -> Vec<String> {
    let mut lines = svg.lines();
    let head = lines.next().unwrap_or("");
    let (width, height) = (attr(head, "width").unwrap_or(0.0), attr(head, "height").unwrap_or(0.0));
    let font = attr(head, "font-size").unwrap_or(16.0);
    let mut problems = Vec::new();
    let mut texts: Vec<Text> = Vec::new();
    let mut last_box: Option<(f64, f64, f64, f64)> = None;
    for line in lines {
        if line.starts_with("<rect") && attr(line, "x").is_some() && !line.contains("fill=\"none\"") {
            let (x, y) = (attr(line, "x").unwrap(), attr(line, "y").unwrap());
            last_box = Some((x, y, x + attr(line, "width").unwrap(), y + attr(line, "height").unwrap()));
        }
        let Some(open) = line.strip_prefix("<text") else { continue };
        let body = &open[open.find('>').unwrap() + 1..open.rfind("</text>").unwrap()];
        let text = body.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&");
        let size = attr(line, "font-size").unwrap_or(font);
        let (x, y) = (attr(line, "x").unwrap(), attr(line, "y").unwrap());
        let w = text.chars().count() as f64 * EM * size;
        let x0 = match () {
            _ if line.contains("text-anchor=\"middle\"") => x - w / 2.0,
            _ if line.contains("text-anchor=\"end\"") => x - w,
            _ => x,
        };
        let t = Text { text, x0, x1: x0 + w, y0: y - size, y1: y + 0.25 * size };
        if t.x0 < 0.0 || t.x1 > width || t.y0 < 0.0 || t.y1 > height {
            problems.push(format!(
                "`{}` ({:.0}..{:.0} × {:.0}..{:.0}) is off the {width} × {height} canvas",
                t.text, t.x0, t.x1, t.y0, t.y1
            ));
        }
        if line.contains("text-anchor=\"middle\"") {
            if let Some((bx0, by0, bx1, by1)) = last_box {
                if t.x0 < bx0 || t.x1 > bx1 || t.y0 < by0 || t.y1 > by1 {
                    problems.push(format!(
                        "label `{}` ({:.1} wide) does not fit its box ({:.1} wide)",
                        t.text,
                        t.x1 - t.x0,
                        bx1 - bx0
                    ));
                }
            }
        }
        texts.push(t);
    }
    // overlaps, by a sweep along x
    texts.sort_by(|a, b| a.x0.total_cmp(&b.x0));
    let mut open: Vec<usize> = Vec::new();
    for i in 0..texts.len() {
        open.retain(|&j| texts[j].x1 > texts[i].x0);
        for &j in &open {
            let (a, b) = (&texts[i], &texts[j]);
            if a.y0 < b.y1 && b.y0 < a.y1 {
                problems.push(format!("`{}` and `{}` print over each other", b.text, a.text));
            }
        }
        open.push(i);
    }
    let n = problems.len();
    problems.truncate(10);
    if n > 10 {
        problems.push(format!("and {} more", n - 10));
    }
    problems
}
