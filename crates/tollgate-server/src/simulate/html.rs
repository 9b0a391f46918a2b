pub fn page(_r: &super::report::Report) -> String { String::new() }
