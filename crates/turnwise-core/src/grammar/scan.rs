//! Linear-time scanning primitives shared by the grammars and the rewards.
//!
//! The reference implementations (Search-R1, ATPO, verl-agent, verifiers) are Python and use
//! `str.find`, `str.count`, `str.strip`, `str.split` and small non-greedy regexes such as
//! `<answer>(.*?)</answer>` (DOTALL). This module reproduces exactly those semantics without a
//! backtracking regex engine:
//!
//! - substring search is `str::find` (Two-Way, linear), counts are non-overlapping like Python's
//!   `str.count`;
//! - `open(.*?)close` has the same leftmost match as a scan "first `open`, then the first `close`
//!   after it" (if the first `open` has no `close` after it, no later `open` has one either);
//! - `finditer` resumes after the end of the previous match;
//! - whitespace follows Python's `str.isspace` (which, unlike Rust's `char::is_whitespace`, also
//!   counts the ASCII separators U+001C..U+001F).
//!
//! Every offset returned here is a byte offset at a `char` boundary: needles are ASCII tags, so a
//! match start and `start + needle.len()` are always boundaries.

/// Python's `str.isspace` for one character.
pub fn py_is_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// Python's `s.strip()` (no argument).
pub fn py_strip(s: &str) -> &str {
    s.trim_matches(py_is_space)
}

/// Python's `s.split()` (no argument): split on runs of whitespace, no empty pieces.
pub fn py_split(s: &str) -> impl Iterator<Item = &str> {
    s.split(py_is_space).filter(|t| !t.is_empty())
}

/// Python's `s.count(needle)` for a non-empty needle (non-overlapping occurrences).
pub fn count(haystack: &str, needle: &str) -> usize {
    debug_assert!(!needle.is_empty());
    haystack.matches(needle).count()
}

/// Python's `s.find(needle, from)`; `from` past the end yields `None`.
pub fn find_from(haystack: &str, needle: &str, from: usize) -> Option<usize> {
    haystack.get(from..)?.find(needle).map(|p| p + from)
}

/// One `open … close` block found in a text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block<'a> {
    /// Byte offset of the opening tag.
    pub start: usize,
    /// Byte offset just past the closing tag.
    pub end: usize,
    /// Text between the tags (not trimmed).
    pub content: &'a str,
}

/// The match of the non-greedy regex `open(.*?)close` (DOTALL) searched from byte `from`.
pub fn block_from<'a>(text: &'a str, open: &str, close: &str, from: usize) -> Option<Block<'a>> {
    let start = find_from(text, open, from)?;
    let content_start = start + open.len();
    let content_end = find_from(text, close, content_start)?;
    Some(Block {
        start,
        end: content_end + close.len(),
        content: &text[content_start..content_end],
    })
}

/// First match of `open(.*?)close` (DOTALL), i.e. Python's `re.search`.
pub fn first_block<'a>(text: &'a str, open: &str, close: &str) -> Option<Block<'a>> {
    block_from(text, open, close, 0)
}

/// All non-overlapping matches of `open(.*?)close` (DOTALL), i.e. Python's `re.finditer`.
pub fn blocks<'a>(text: &'a str, open: &str, close: &str) -> Vec<Block<'a>> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(b) = block_from(text, open, close, from) {
        from = b.end;
        out.push(b);
    }
    out
}

/// Last match of `open(.*?)close` in `finditer` order.
pub fn last_block<'a>(text: &'a str, open: &str, close: &str) -> Option<Block<'a>> {
    let mut last = None;
    let mut from = 0;
    while let Some(b) = block_from(text, open, close, from) {
        from = b.end;
        last = Some(b);
    }
    last
}

/// A tag token found by [`tag_tokens`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TagToken<'a> {
    /// Tag name without brackets or slash (e.g. `"think"`).
    pub name: &'a str,
    /// `true` for `</name>`.
    pub closing: bool,
    /// Byte offset of `<`.
    pub start: usize,
    /// Byte offset just past `>`.
    pub end: usize,
}

/// Scans `text` left to right for the tags `<name>` / `</name>` with `name` in `names`
/// (Python `re.split(r"(</?(?:a|b|c)>)", text)` keeps exactly these tokens, in this order).
pub fn tag_tokens<'a>(text: &str, names: &[&'a str]) -> Vec<TagToken<'a>> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(rel) = text.get(i..).and_then(|s| s.find('<')) {
        let lt = i + rel;
        let (closing, name_start) = if bytes.get(lt + 1) == Some(&b'/') {
            (true, lt + 2)
        } else {
            (false, lt + 1)
        };
        let hit = names.iter().find(|n| {
            let stop = name_start + n.len();
            bytes.get(name_start..stop) == Some(n.as_bytes()) && bytes.get(stop) == Some(&b'>')
        });
        match hit {
            Some(n) => {
                let end = name_start + n.len() + 1;
                out.push(TagToken {
                    name: n,
                    closing,
                    start: lt,
                    end,
                });
                i = end;
            }
            None => i = lt + 1,
        }
    }
    out
}

/// Scans for any XML-like tag `</?[A-Za-z][A-Za-z0-9_-]*>` and returns its tokens.
///
/// Used by the MT-PPO "no extra tags" rules (§2.4), where every tag other than the allowed ones
/// counts against the format.
pub fn any_tags(text: &str) -> Vec<TagToken<'_>> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(rel) = text.get(i..).and_then(|s| s.find('<')) {
        let lt = i + rel;
        let (closing, name_start) = if bytes.get(lt + 1) == Some(&b'/') {
            (true, lt + 2)
        } else {
            (false, lt + 1)
        };
        let mut j = name_start;
        if bytes.get(j).is_some_and(u8::is_ascii_alphabetic) {
            j += 1;
            while bytes
                .get(j)
                .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'-')
            {
                j += 1;
            }
            if bytes.get(j) == Some(&b'>') {
                // name_start..j is ASCII, hence a valid slice.
                out.push(TagToken {
                    name: &text[name_start..j],
                    closing,
                    start: lt,
                    end: j + 1,
                });
                i = j + 1;
                continue;
            }
        }
        i = lt + 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_whitespace_semantics() {
        assert_eq!(py_strip("\u{1c} a b \u{3000}"), "a b");
        assert_eq!(
            py_split(" a\t b\u{1f}c ").collect::<Vec<_>>(),
            vec!["a", "b", "c"]
        );
    }

    #[test]
    fn blocks_match_finditer() {
        let t = "<a>1</a> <a>2 <a>3</a></a>";
        let got: Vec<&str> = blocks(t, "<a>", "</a>").iter().map(|b| b.content).collect();
        // Python: re.findall(r"<a>(.*?)</a>", t, re.S) == ['1', '2 <a>3']
        assert_eq!(got, vec!["1", "2 <a>3"]);
        assert_eq!(last_block(t, "<a>", "</a>").unwrap().content, "2 <a>3");
        assert!(first_block("<a>unclosed", "<a>", "</a>").is_none());
    }

    #[test]
    fn tag_tokens_and_any_tags() {
        let t = "x<think>é</think ><search></search>";
        let toks = tag_tokens(t, &["think", "search"]);
        assert_eq!(toks.len(), 3);
        assert_eq!(
            (toks[0].name, toks[0].closing, toks[0].start),
            ("think", false, 1)
        );
        let any = any_tags("a < b <tool_call> </x-y> <1>");
        let names: Vec<&str> = any.iter().map(|t| t.name).collect();
        assert_eq!(names, vec!["tool_call", "x-y"]);
    }
}
