//! The DiphomaJob reference in Markdown, generated from the CRD (`docs/crd-reference.md`, what
//! `diphoma-operator crd --markdown` prints; a test keeps the committed file fresh). Pure.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceDefinition, JSONSchemaProps, JSONSchemaPropsOrArray,
};

/// Fields deeper than this (counted from `spec`/`status`) are left to their Kubernetes types'
/// own reference (affinity, tolerations, …).
const MAX_DEPTH: usize = 3;

/// Fields of a Kubernetes type as a whole, left to its own reference (`kubectl explain`): the
/// pod template is core/v1's `PodTemplateSpec`, with its own reference.
const KUBERNETES_TYPES: [(&str, &str); 1] = [("spec.template", "core/v1 PodTemplateSpec")];

/// The reference page of `crd`'s first version: printer columns, then one table per top-level
/// section (`spec`, `status`) with each field's path, type, constraints and description, then the
/// CEL validation rules with their messages.
pub fn crd_markdown(crd: &CustomResourceDefinition) -> String {
    let names = &crd.spec.names;
    let version = &crd.spec.versions[0];
    let mut out = format!(
        "# {kind} reference\n\n<!-- Generated from the CRD by `make generate` (diphoma-operator crd --markdown); do not edit. -->\n\n\
         `{group}/{v}`, kind `{kind}`, plural `{plural}`, short names: {short}. Namespaced.\n",
        kind = names.kind,
        group = crd.spec.group,
        v = version.name,
        plural = names.plural,
        short = names
            .short_names
            .iter()
            .flatten()
            .map(|s| format!("`{s}`"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    if let Some(cols) = &version.additional_printer_columns {
        out += "\n## `kubectl get` columns\n\n| column | from |\n|---|---|\n";
        for c in cols {
            out += &format!("| {} | `{}` |\n", c.name, c.json_path);
        }
    }
    let schema = version
        .schema
        .as_ref()
        .and_then(|s| s.open_api_v3_schema.as_ref());
    // Rules on the whole object (e.g. on `metadata.name`) first.
    let mut rules: Vec<(String, String, String)> = schema
        .and_then(|s| s.x_kubernetes_validations.clone())
        .into_iter()
        .flatten()
        .map(|r| {
            let message = r.message.unwrap_or_default();
            (
                ".".to_owned(),
                r.rule.replace('|', "\\|"),
                one_line(&message),
            )
        })
        .collect();
    for section in ["spec", "status"] {
        let Some(props) = schema.and_then(|s| s.properties.as_ref()?.get(section)) else {
            continue;
        };
        out += &format!(
            "\n## `{section}`\n\n{}\n\n| field | type | constraints | description |\n|---|---|---|---|\n",
            one_line(props.description.as_deref().unwrap_or_default())
        );
        fields(section, props, 1, &mut out, &mut rules);
    }
    if !rules.is_empty() {
        out += "\n## Validation rules (CEL)\n\nThe API server refuses a manifest that breaks one, with this message.\n\n| on | rule | message |\n|---|---|---|\n";
        for (path, rule, message) in rules {
            out += &format!("| `{path}` | `{rule}` | {message} |\n");
        }
    }
    out
}

/// Appends a row per property of `s` (at `path`) and descends into objects and arrays of objects.
fn fields(
    path: &str,
    s: &JSONSchemaProps,
    depth: usize,
    out: &mut String,
    rules: &mut Vec<(String, String, String)>,
) {
    for r in s.x_kubernetes_validations.iter().flatten() {
        let message = r.message.clone().unwrap_or_default();
        rules.push((
            path.to_owned(),
            r.rule.replace('|', "\\|"),
            one_line(&message),
        ));
    }
    let required = s.required.clone().unwrap_or_default();
    for (name, p) in s.properties.iter().flatten() {
        let child = format!("{path}.{name}");
        let kubernetes = KUBERNETES_TYPES.iter().find(|(at, _)| *at == child);
        let (ty, inner) = match kubernetes {
            Some((_, name)) => (format!("object ({name})"), None),
            None => type_of(p),
        };
        let mut constraints = constraints(p);
        if required.contains(name) {
            constraints.insert(0, "required".into());
        }
        out.push_str(&format!(
            "| `{child}` | {ty} | {} | {} |\n",
            constraints.join(", "),
            one_line(p.description.as_deref().unwrap_or_default())
        ));
        if depth < MAX_DEPTH && kubernetes.is_none() {
            let next = if inner.is_some() {
                format!("{child}[]")
            } else {
                child
            };
            fields(&next, inner.unwrap_or(p), depth + 1, out, rules);
        }
    }
}

/// The field's type for the table, and the item schema of an array.
fn type_of(p: &JSONSchemaProps) -> (String, Option<&JSONSchemaProps>) {
    let base = p.type_.clone().unwrap_or_else(|| {
        if p.x_kubernetes_int_or_string == Some(true) {
            "int or string".into()
        } else {
            "any".into()
        }
    });
    match &p.items {
        Some(JSONSchemaPropsOrArray::Schema(item)) => {
            let (t, _) = type_of(item);
            (format!("[]{t}"), Some(item))
        }
        _ if p.x_kubernetes_preserve_unknown_fields == Some(true) && base == "object" => {
            ("object (free-form)".into(), None)
        }
        _ => (base, None),
    }
}

/// Bounds, enums and defaults of a field, as short phrases.
fn constraints(p: &JSONSchemaProps) -> Vec<String> {
    let num = |x: f64| {
        if x.fract() == 0.0 {
            format!("{}", x as i64)
        } else {
            x.to_string()
        }
    };
    let mut c = vec![];
    if let Some(m) = p.minimum {
        c.push(format!("≥ {}", num(m)));
    }
    if let Some(m) = p.maximum {
        c.push(format!("≤ {}", num(m)));
    }
    if let Some(m) = p.min_length {
        c.push(format!("length ≥ {m}"));
    }
    if let Some(e) = &p.enum_ {
        let vals: Vec<String> = e.iter().map(|v| format!("`{}`", v.0)).collect();
        c.push(format!("one of {}", vals.join(", ")).replace('"', ""));
    }
    if let Some(d) = &p.default {
        c.push(format!("default `{}`", d.0));
    }
    if p.nullable == Some(true) {
        c.push("nullable".into());
    }
    c
}

/// A description on one table line (paragraphs joined, pipes escaped).
fn one_line(s: &str) -> String {
    s.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|")
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;

    #[test]
    fn every_spec_field_rule_and_column_is_in_the_reference() {
        let md = crd_markdown(&crate::api::DiphomaJob::crd());
        for needle in [
            "| `spec.replicas` | integer | required, ≥ 1, ≤ 4096 |",
            "| `spec.elastic.minReplicas` |",
            "| `spec.runPolicy.backoffLimit` |",
            "| `spec.template` | object (core/v1 PodTemplateSpec) | required |",
            "| `status.conditions[].type` |",
            "| Phase | `.status.phase` |",
            "spec.elastic.minReplicas must not exceed spec.elastic.maxReplicas",
        ] {
            assert!(md.contains(needle), "{needle} missing from:\n{md}");
        }
        assert!(
            !md.contains("spec.placement.affinity.nodeAffinity")
                && !md.contains("| `spec.template.spec"),
            "Kubernetes types are not expanded"
        );
    }
}
