package helmtest

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// chartDir is the chart, from this package's directory.
const chartDir = "../helm/deltagym"

// Every rendering is of release "rel" in namespace "ns".
const (
	release   = "rel"
	namespace = "ns"
)

// manifest is what one rendering of the chart made, each object in its API type.
type manifest struct {
	daemonSets      []*appsv1.DaemonSet
	statefulSets    []*appsv1.StatefulSet
	services        []*corev1.Service
	secrets         []*corev1.Secret
	serviceAccounts []*corev1.ServiceAccount
	budgets         []*policyv1.PodDisruptionBudget
	policies        []*networkingv1.NetworkPolicy
}

// helm returns the helm binary $HELM names, or skips the test.
func helm(t *testing.T) string {
	t.Helper()
	h := os.Getenv("HELM")
	if h == "" {
		t.Skip("$HELM names no helm binary: `make helm-test` installs the pinned helm and sets it")
	}
	return h
}

// template runs helm template on the chart with the values given as YAML (none: the chart's
// defaults); it returns the output, or an error that holds helm's message.
func template(t *testing.T, values string) (string, error) {
	t.Helper()
	args := []string{"template", release, chartDir, "--namespace", namespace}
	if values != "" {
		f := filepath.Join(t.TempDir(), "values.yaml")
		if err := os.WriteFile(f, []byte(values), 0o600); err != nil {
			t.Fatal(err)
		}
		args = append(args, "--values", f)
	}
	cmd := exec.CommandContext(t.Context(), helm(t), args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("helm template: %w: %s", err, stderr.String())
	}
	return stdout.String(), nil
}

// render renders the chart with values and decodes every object, failing the test on any error.
func render(t *testing.T, values string) *manifest {
	t.Helper()
	out, err := template(t, values)
	if err != nil {
		t.Fatal(err)
	}
	m, err := decode(out)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// docSep splits a YAML stream into its documents.
var docSep = regexp.MustCompile(`(?m)^---[ \t]*$`)

// decode decodes each document of out strictly into the API type of its apiVersion and kind.
func decode(out string) (*manifest, error) {
	m := &manifest{}
	seen := map[string]bool{}
	for _, doc := range docSep.Split(out, -1) {
		if blank(doc) {
			continue
		}
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal([]byte(doc), &tm); err != nil {
			return nil, fmt.Errorf("reading a document's kind: %w\n%s", err, doc)
		}
		obj, add := m.slot(tm.APIVersion, tm.Kind)
		if obj == nil {
			return nil, fmt.Errorf("an object of apiVersion %q kind %q, which the chart is not known to make:\n%s", tm.APIVersion, tm.Kind, doc)
		}
		if err := strict([]byte(doc), obj); err != nil {
			return nil, fmt.Errorf("decoding %s %s: %w\n%s", tm.APIVersion, tm.Kind, err, doc)
		}
		meta := obj.(metav1.Object)
		key := tm.Kind + "/" + meta.GetName()
		switch {
		case meta.GetName() == "":
			return nil, fmt.Errorf("a %s without a name", tm.Kind)
		case meta.GetNamespace() != namespace:
			return nil, fmt.Errorf("%s in namespace %q, not the release's", key, meta.GetNamespace())
		case seen[key]:
			return nil, fmt.Errorf("%s twice", key)
		}
		seen[key] = true
		add()
	}
	return m, nil
}

// strict decodes the YAML doc into obj as the API server does, and stricter: field names match
// in case (encoding/json's would not), and an unknown or duplicate field is an error.
func strict(doc []byte, obj any) error {
	j, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return err
	}
	strictErrs, err := json.UnmarshalStrict(j, obj, json.DisallowDuplicateFields, json.DisallowUnknownFields)
	return errors.Join(append(strictErrs, err)...)
}

// slot returns a new object of the API type of apiVersion and kind and a function that adds it
// to m, or nil for a kind the chart is not known to make.
func (m *manifest) slot(apiVersion, kind string) (any, func()) {
	switch apiVersion + " " + kind {
	case "apps/v1 DaemonSet":
		o := &appsv1.DaemonSet{}
		return o, func() { m.daemonSets = append(m.daemonSets, o) }
	case "apps/v1 StatefulSet":
		o := &appsv1.StatefulSet{}
		return o, func() { m.statefulSets = append(m.statefulSets, o) }
	case "v1 Service":
		o := &corev1.Service{}
		return o, func() { m.services = append(m.services, o) }
	case "v1 Secret":
		o := &corev1.Secret{}
		return o, func() { m.secrets = append(m.secrets, o) }
	case "v1 ServiceAccount":
		o := &corev1.ServiceAccount{}
		return o, func() { m.serviceAccounts = append(m.serviceAccounts, o) }
	case "policy/v1 PodDisruptionBudget":
		o := &policyv1.PodDisruptionBudget{}
		return o, func() { m.budgets = append(m.budgets, o) }
	case "networking.k8s.io/v1 NetworkPolicy":
		o := &networkingv1.NetworkPolicy{}
		return o, func() { m.policies = append(m.policies, o) }
	}
	return nil, nil
}

// blank reports whether a document holds nothing but comments and white space.
func blank(doc string) bool {
	for line := range strings.SplitSeq(doc, "\n") {
		if l := strings.TrimSpace(line); l != "" && !strings.HasPrefix(l, "#") {
			return false
		}
	}
	return true
}

// The tests of the decoder itself: a checker that accepted anything would prove nothing.
func TestDecodeRefuses(t *testing.T) {
	for name, doc := range map[string]string{
		"unknown field":     "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: ns}\nspec: {headless: true}\n",
		"field's case":      "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: ns}\nspec: {clusterIp: None}\n",
		"duplicate key":     "apiVersion: v1\nkind: Secret\nmetadata: {name: a, namespace: ns}\ntype: Opaque\ntype: Opaque\n",
		"unknown kind":      "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: a, namespace: ns}\n",
		"wrong type":        "apiVersion: v1\nkind: Service\nmetadata: {name: a, namespace: ns}\nspec: {ports: [{port: eighty}]}\n",
		"other namespace":   "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: a, namespace: default}\n",
		"twice":             "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: a, namespace: ns}\n---\napiVersion: v1\nkind: ServiceAccount\nmetadata: {name: a, namespace: ns}\n",
		"misplaced in spec": "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: a, namespace: ns}\nspec: {template: {spec: {containers: [{name: c, privileged: true}]}}}\n",
	} {
		t.Run(name, func(t *testing.T) {
			if _, err := decode(doc); err == nil {
				t.Fatalf("decoded:\n%s", doc)
			}
		})
	}
	m, err := decode("# Source: x\n---\napiVersion: v1\nkind: ServiceAccount\nmetadata: {name: a, namespace: ns}\nautomountServiceAccountToken: false\n")
	if err != nil || len(m.serviceAccounts) != 1 {
		t.Fatalf("a valid stream: %v %+v", err, m)
	}
	if _, err := template(t, "bogus: [\n"); err == nil {
		t.Fatal("helm rendered values that are not YAML")
	}
}
