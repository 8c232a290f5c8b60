package helmtest

import (
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// version is the project's version, the one line of VERSION.
func version(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../../VERSION")
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

// The chart's appVersion is VERSION, the node image's tag; its version is VERSION in SemVer 2.
func TestChartVersion(t *testing.T) {
	b, err := os.ReadFile(chartDir + "/Chart.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var chart struct {
		Version    string `json:"version"`
		AppVersion string `json:"appVersion"`
	}
	if err := yaml.Unmarshal(b, &chart); err != nil {
		t.Fatal(err)
	}
	v := version(t)
	if chart.AppVersion != v {
		t.Errorf("Chart.yaml appVersion %q, VERSION %q (make generate writes it)", chart.AppVersion, v)
	}
	semver := regexp.MustCompile(`^([0-9]+\.[0-9]+\.[0-9]+)((a|b|rc)[0-9]+)?$`).ReplaceAllString(v, "$1-$2")
	semver = strings.TrimSuffix(semver, "-")
	if chart.Version != semver {
		t.Errorf("Chart.yaml version %q, want %q (VERSION %q in SemVer 2)", chart.Version, semver, v)
	}
}

// want is what a rendering's nodes must look like.
type want struct {
	image                string
	port                 int32
	dataDir              string
	propagation          corev1.MountPropagationMode
	grace                int64
	ipv6                 bool
	tokenSecret          string
	tokenKey             string
	databaseSecret       string
	databaseKey          string
	networkPolicy        bool
	bundled              bool
	externalDatabasePort int32
}

// defaults is want for the chart's default values.
func defaults(t *testing.T) want {
	return want{
		image: "deltagym/node:" + version(t), port: 8080, dataDir: "/var/lib/deltagym",
		propagation: corev1.MountPropagationBidirectional, grace: 300,
		tokenSecret: "rel-deltagym-token", tokenKey: "token",
		databaseSecret: "rel-deltagym-database", databaseKey: "url",
		networkPolicy: true, bundled: true,
	}
}

// The chart's defaults: nodes with the bundled Postgres.
func TestDefaults(t *testing.T) {
	t.Parallel()
	m := render(t, "")
	w := defaults(t)
	pod := checkNodes(t, m, w)
	pg := one(t, "StatefulSet", m.statefulSets)
	if pg.Name != "rel-deltagym-postgres" || pg.Spec.Replicas == nil || *pg.Spec.Replicas != 1 {
		t.Errorf("the bundled Postgres: %s, %v replicas", pg.Name, pg.Spec.Replicas)
	}
	pgLabels := labels.Set(pg.Spec.Template.Labels)
	selects(t, "the Postgres StatefulSet", pg.Spec.Selector, pgLabels)
	svc := service(t, m, "rel-deltagym-postgres")
	if !labels.SelectorFromSet(svc.Spec.Selector).Matches(pgLabels) || svc.Spec.Ports[0].Port != 5432 {
		t.Errorf("the Postgres Service: selector %v, ports %+v", svc.Spec.Selector, svc.Spec.Ports)
	}
	if len(pg.Spec.VolumeClaimTemplates) != 1 || pg.Spec.VolumeClaimTemplates[0].Name != "data" {
		t.Errorf("the Postgres data is not on a PVC: %+v", pg.Spec.VolumeClaimTemplates)
	}
	db := secret(t, m, w.databaseSecret)
	password := string(db.Data["password"])
	if len(password) < 32 {
		t.Errorf("the generated Postgres password %q", password)
	}
	pgEnv := envVar(t, pg.Spec.Template.Spec.Containers[0], "POSTGRES_PASSWORD")
	if ref := pgEnv.ValueFrom.SecretKeyRef; ref == nil || ref.Name != w.databaseSecret || ref.Key != "password" {
		t.Errorf("POSTGRES_PASSWORD from %+v", pgEnv.ValueFrom)
	}
	u, err := url.Parse(string(db.Data["url"]))
	if err != nil {
		t.Fatal(err)
	}
	pw, _ := u.User.Password()
	if u.Scheme != "postgres" || u.User.Username() != "deltagym" || pw != password ||
		u.Host != "rel-deltagym-postgres.ns.svc.cluster.local:5432" || u.Path != "/deltagym" {
		t.Errorf("the ledger's URL %s does not name the bundled Postgres with its password", u.Redacted())
	}
	if len(pod.InitContainers) != 1 || envVar(t, pod.InitContainers[0], "PGHOST").Value != "rel-deltagym-postgres.ns.svc.cluster.local" {
		t.Errorf("the nodes do not wait for the bundled Postgres: %+v", pod.InitContainers)
	}
	pgPolicy := policyFor(t, m, pgLabels)
	if !admits(pgPolicy.Spec.Ingress, labels.Set(pod.Labels), 5432) {
		t.Errorf("the Postgres NetworkPolicy does not admit the nodes:\n%s", dump(pgPolicy.Spec.Ingress))
	}
	if len(m.policies) != 2 {
		t.Errorf("%d NetworkPolicies, want the nodes' and Postgres's", len(m.policies))
	}
	api := service(t, m, "rel-deltagym")
	if api.Spec.Type != corev1.ServiceTypeClusterIP || !labels.SelectorFromSet(api.Spec.Selector).Matches(labels.Set(pod.Labels)) ||
		api.Spec.Ports[0].TargetPort != intstr.FromString("api") {
		t.Errorf("the API Service: %+v", api.Spec)
	}
	// The budget selects the nodes, not Postgres.
	if sel, _ := metav1.LabelSelectorAsSelector(m.budgets[0].Spec.Selector); sel.Matches(pgLabels) {
		t.Error("the PodDisruptionBudget selects the Postgres pod")
	}
}

// An external Postgres by URL, with a token given: no bundled Postgres, the URL and the token in
// the chart's Secrets.
func TestExternalDatabase(t *testing.T) {
	t.Parallel()
	const dbURL = "postgres://ledger:pw@db.example.net:6432/ledger?sslmode=require"
	m := render(t, `
postgres: {enabled: false}
database: {url: "`+dbURL+`"}
auth: {token: given-token-0123456789}
networkPolicy:
  database: {port: 6432}
`)
	w := defaults(t)
	w.bundled, w.externalDatabasePort = false, 6432
	pod := checkNodes(t, m, w)
	if len(m.statefulSets) != 0 || len(pod.InitContainers) != 0 {
		t.Errorf("an external database, yet %d StatefulSets and %d init containers", len(m.statefulSets), len(pod.InitContainers))
	}
	for _, s := range m.services {
		if strings.Contains(s.Name, "postgres") {
			t.Errorf("an external database, yet Service %s", s.Name)
		}
	}
	if got := string(secret(t, m, w.databaseSecret).Data["url"]); got != dbURL {
		t.Errorf("the database Secret holds %q, want %q", got, dbURL)
	}
	if _, ok := secret(t, m, w.databaseSecret).Data["password"]; ok {
		t.Error("an external database, yet a generated password")
	}
	if got := string(secret(t, m, w.tokenSecret).Data["token"]); got != "given-token-0123456789" {
		t.Errorf("the token Secret holds %q, not auth.token", got)
	}
	if len(m.policies) != 1 {
		t.Errorf("%d NetworkPolicies, want the nodes' alone", len(m.policies))
	}
}

// Existing Secrets for the token and the database: the chart makes no Secret and reads theirs.
func TestExistingSecrets(t *testing.T) {
	t.Parallel()
	m := render(t, `
postgres: {enabled: false}
database: {existingSecret: ledger-db, existingSecretKey: dsn}
auth: {existingSecret: api-auth, existingSecretKey: bearer}
`)
	w := defaults(t)
	w.bundled, w.externalDatabasePort = false, 5432
	w.tokenSecret, w.tokenKey = "api-auth", "bearer"
	w.databaseSecret, w.databaseKey = "ledger-db", "dsn"
	checkNodes(t, m, w)
	if len(m.secrets) != 0 {
		t.Errorf("existing Secrets, yet the chart makes %d", len(m.secrets))
	}
}

// networkPolicy.enabled=false makes no NetworkPolicy.
func TestNetworkPolicyOff(t *testing.T) {
	t.Parallel()
	m := render(t, "networkPolicy: {enabled: false}\n")
	w := defaults(t)
	w.networkPolicy = false
	checkNodes(t, m, w)
}

// Values that change the nodes: resources, scheduling, image, port, data directory, grace
// period, IPv6, extra flags; no API Service; the bundled Postgres on an emptyDir.
func TestCustomNodes(t *testing.T) {
	t.Parallel()
	m := render(t, `
image: {repository: registry.example.net/deltagym/node, tag: 9.9.9-test}
node:
  port: 9090
  dataDir: /srv/deltagym
  dataMountPropagation: HostToContainer
  terminationGracePeriodSeconds: 600
  shutdownMarginSeconds: 60
  ipFamily: IPv6
  extraArgs: ["--pool-size", "4"]
resources:
  requests: {cpu: "8", memory: 32Gi}
  limits: {memory: 48Gi}
nodeSelector: {deltagym.example.net/node: "true"}
tolerations:
  - {key: dedicated, operator: Equal, value: deltagym, effect: NoSchedule}
updateStrategy: {maxUnavailable: 2}
service: {enabled: false}
postgres:
  persistence: {enabled: false}
networkPolicy:
  clients:
    - namespaceSelector: {matchLabels: {team: rl}}
  extraEgress:
    - to: [{ipBlock: {cidr: 151.101.0.0/16}}]
      ports: [{port: 443, protocol: TCP}]
`)
	w := defaults(t)
	w.image, w.port, w.dataDir, w.propagation = "registry.example.net/deltagym/node:9.9.9-test", 9090, "/srv/deltagym", corev1.MountPropagationHostToContainer
	w.grace, w.ipv6 = 600, true
	pod := checkNodes(t, m, w)
	c := pod.Containers[0]
	if flag(t, c.Args, "--drain-timeout") != "480s" || flag(t, c.Args, "--shutdown-timeout") != "60s" {
		t.Errorf("--drain-timeout %s, --shutdown-timeout %s; want the grace period less the shutdown and the margin, 480s, and the shutdown's 60s",
			flag(t, c.Args, "--drain-timeout"), flag(t, c.Args, "--shutdown-timeout"))
	}
	if !slices.Equal(c.Args[len(c.Args)-2:], []string{"--pool-size", "4"}) {
		t.Errorf("node.extraArgs are not the last flags: %q", c.Args)
	}
	if c.Resources.Requests.Cpu().String() != "8" || c.Resources.Requests.Memory().String() != "32Gi" || c.Resources.Limits.Memory().String() != "48Gi" {
		t.Errorf("resources %+v", c.Resources)
	}
	if pod.NodeSelector["deltagym.example.net/node"] != "true" || len(pod.Tolerations) != 1 || pod.Tolerations[0].Value != "deltagym" {
		t.Errorf("scheduling: nodeSelector %v, tolerations %+v", pod.NodeSelector, pod.Tolerations)
	}
	if got := m.daemonSets[0].Spec.UpdateStrategy.RollingUpdate.MaxUnavailable.IntValue(); got != 2 {
		t.Errorf("maxUnavailable %d, want 2", got)
	}
	if len(m.services) != 2 { // the headless one and Postgres's
		t.Errorf("service.enabled=false, yet %d Services", len(m.services))
	}
	pgPod := one(t, "StatefulSet", m.statefulSets).Spec
	if len(pgPod.VolumeClaimTemplates) != 0 || volume(t, pgPod.Template.Spec, "data").EmptyDir == nil {
		t.Error("postgres.persistence.enabled=false, yet the data is not an emptyDir")
	}
	np := policyFor(t, m, labels.Set(pod.Labels))
	last := np.Spec.Egress[len(np.Spec.Egress)-1]
	if len(last.To) != 1 || last.To[0].IPBlock == nil || last.To[0].IPBlock.CIDR != "151.101.0.0/16" {
		t.Errorf("networkPolicy.extraEgress is not in the policy:\n%s", dump(np.Spec.Egress))
	}
	clients := np.Spec.Ingress[1].From
	if len(clients) != 1 || clients[0].NamespaceSelector == nil || clients[0].NamespaceSelector.MatchLabels["team"] != "rl" {
		t.Errorf("networkPolicy.clients are not admitted:\n%s", dump(np.Spec.Ingress))
	}
}

// Values that must not render, each refused with the message that says why.
func TestBadValues(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct{ values, message string }{
		"no database": {"postgres: {enabled: false}\n",
			"the ledger needs a database: set postgres.enabled=true for a bundled Postgres (trials), or database.url or database.existingSecret for an external one (production)"},
		"two databases":  {"database: {url: postgres://db/x}\n", "exclude each other: set postgres.enabled=false"},
		"url and secret": {"postgres: {enabled: false}\ndatabase: {url: postgres://db/x, existingSecret: s}\n", "database.url and database.existingSecret exclude each other"},
		"two tokens":     {"auth: {token: t, existingSecret: s}\n", "auth.token and auth.existingSecret exclude each other"},
		"drain past the grace period": {"node: {terminationGracePeriodSeconds: 90, shutdownMarginSeconds: 30}\n",
			"node.terminationGracePeriodSeconds (90) must exceed node.shutdownSeconds plus node.shutdownMarginSeconds (90)"},
		"unknown key":         {"node: {dataDirectory: /x}\n", "additional properties 'dataDirectory' not allowed"},
		"propagation":         {"node: {dataMountPropagation: Sideways}\n", "/node/dataMountPropagation"},
		"relative data dir":   {"node: {dataDir: var/lib/deltagym}\n", "/node/dataDir"},
		"port":                {"node: {port: 70000}\n", "/node/port"},
		"token with a space":  {"auth: {token: two words}\n", "/auth/token"},
		"database URL scheme": {"postgres: {enabled: false}\ndatabase: {url: mysql://db/x}\n", "/database/url"},
		"resources":           {"resources: {requests: {cpu: lots}}\n", "/resources/requests/cpu"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			out, err := template(t, c.values)
			if err == nil {
				t.Fatalf("rendered:\n%s", out)
			}
			if !strings.Contains(err.Error(), c.message) {
				t.Fatalf("refused without saying %q: %v", c.message, err)
			}
		})
	}
}

// checkNodes checks the nodes' DaemonSet and what it relies on, and returns its pod spec with
// its labels.
func checkNodes(t *testing.T, m *manifest, w want) podWithLabels {
	t.Helper()
	ds := one(t, "DaemonSet", m.daemonSets)
	podLabels := labels.Set(ds.Spec.Template.Labels)
	selects(t, "the DaemonSet", ds.Spec.Selector, podLabels)
	pod := ds.Spec.Template.Spec
	checkRollout(t, ds)
	checkServiceAccount(t, m, pod)
	if len(pod.Containers) != 1 {
		t.Fatalf("%d containers in a node's pod", len(pod.Containers))
	}
	c := pod.Containers[0]
	if c.Image != w.image {
		t.Errorf("image %q, want %q", c.Image, w.image)
	}
	if c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
		t.Error("the node's container is not privileged")
	}
	if pod.EnableServiceLinks == nil || *pod.EnableServiceLinks {
		t.Error("service links would put DELTAGYM_* variables into the server's environment")
	}
	checkProbes(t, c, w.port)
	checkFlags(t, m, c, pod, podLabels, w)
	checkEnv(t, m, c, w)
	checkVolumes(t, pod, c, w)
	pdb := one(t, "PodDisruptionBudget", m.budgets)
	selects(t, "the PodDisruptionBudget", pdb.Spec.Selector, podLabels)
	if w.networkPolicy {
		checkNetworkPolicy(t, m, podLabels, w)
	} else if len(m.policies) != 0 {
		t.Errorf("networkPolicy.enabled=false, yet %d NetworkPolicies", len(m.policies))
	}
	return podWithLabels{pod, podLabels}
}

// podWithLabels is a pod template's spec with its labels.
type podWithLabels struct {
	corev1.PodSpec
	Labels labels.Set
}

func checkRollout(t *testing.T, ds *appsv1.DaemonSet) {
	t.Helper()
	u := ds.Spec.UpdateStrategy
	if u.Type != appsv1.RollingUpdateDaemonSetStrategyType || u.RollingUpdate == nil || u.RollingUpdate.MaxUnavailable == nil {
		t.Fatalf("update strategy %+v, want RollingUpdate", u)
	}
	// Two servers may not hold one data directory: never a surge.
	if u.RollingUpdate.MaxSurge == nil || u.RollingUpdate.MaxSurge.IntValue() != 0 {
		t.Errorf("maxSurge %v, want 0", u.RollingUpdate.MaxSurge)
	}
}

func checkServiceAccount(t *testing.T, m *manifest, pod corev1.PodSpec) {
	t.Helper()
	if pod.AutomountServiceAccountToken == nil || *pod.AutomountServiceAccountToken {
		t.Error("the node's pod mounts a service account token")
	}
	sa := one(t, "ServiceAccount", m.serviceAccounts)
	if sa.Name != pod.ServiceAccountName || sa.AutomountServiceAccountToken == nil || *sa.AutomountServiceAccountToken {
		t.Errorf("ServiceAccount %s (automount %s), the pod's %s", sa.Name, dump(sa.AutomountServiceAccountToken), pod.ServiceAccountName)
	}
}

// checkProbes checks that every probe is the gRPC health check on the API port.
func checkProbes(t *testing.T, c corev1.Container, port int32) {
	t.Helper()
	if len(c.Ports) != 1 || c.Ports[0].Name != "api" || c.Ports[0].ContainerPort != port {
		t.Errorf("container ports %+v, want api %d", c.Ports, port)
	}
	for name, p := range map[string]*corev1.Probe{"startup": c.StartupProbe, "readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
		switch {
		case p == nil:
			t.Errorf("no %s probe", name)
		case p.GRPC == nil || p.Exec != nil || p.HTTPGet != nil || p.TCPSocket != nil:
			t.Errorf("the %s probe is not a gRPC one: %s", name, dump(p.ProbeHandler))
		case p.GRPC.Port != port:
			t.Errorf("the %s probe checks port %d, the API's is %d", name, p.GRPC.Port, port)
		case p.GRPC.Service != nil && *p.GRPC.Service != "":
			t.Errorf("the %s probe asks for service %q, not the server's overall health", name, *p.GRPC.Service)
		}
	}
}

// checkFlags checks the flags of deltagym serve.
func checkFlags(t *testing.T, m *manifest, c corev1.Container, pod corev1.PodSpec, podLabels labels.Set, w want) {
	t.Helper()
	addr := fmt.Sprintf("0.0.0.0:%d", w.port)
	if w.ipv6 {
		addr = fmt.Sprintf("[::]:%d", w.port)
	}
	if got := flag(t, c.Args, "--addr"); got != addr {
		t.Errorf("--addr %s, want %s", got, addr)
	}
	if got := flag(t, c.Args, "--data"); got != w.dataDir {
		t.Errorf("--data %s, want %s", got, w.dataDir)
	}
	if !slices.Contains(c.Args, "--public-health") {
		t.Error("no --public-health: the kubelet's probes carry no token")
	}
	drain, err := time.ParseDuration(flag(t, c.Args, "--drain-timeout"))
	if err != nil {
		t.Fatal(err)
	}
	stop, err := time.ParseDuration(flag(t, c.Args, "--shutdown-timeout"))
	if err != nil {
		t.Fatal(err)
	}
	if pod.TerminationGracePeriodSeconds == nil || *pod.TerminationGracePeriodSeconds != w.grace {
		t.Fatalf("terminationGracePeriodSeconds %v, want %d", pod.TerminationGracePeriodSeconds, w.grace)
	}
	if grace := time.Duration(w.grace) * time.Second; drain <= 0 || stop <= 0 || drain+stop >= grace {
		t.Errorf("--drain-timeout %v and --shutdown-timeout %v, not below the grace period %v together", drain, stop, grace)
	}
	const headless = "rel-deltagym-nodes"
	if got, want := flag(t, c.Args, "--peers"), fmt.Sprintf("dns:%s.ns.svc.cluster.local:%d", headless, w.port); got != want {
		t.Errorf("--peers %s, want %s", got, want)
	}
	svc := service(t, m, headless)
	if svc.Spec.ClusterIP != corev1.ClusterIPNone {
		t.Errorf("Service %s is not headless: clusterIP %q", headless, svc.Spec.ClusterIP)
	}
	if !labels.SelectorFromSet(svc.Spec.Selector).Matches(podLabels) {
		t.Errorf("Service %s selects %v, not the nodes", headless, svc.Spec.Selector)
	}
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != w.port || svc.Spec.Ports[0].TargetPort != intstr.FromString("api") {
		t.Errorf("Service %s ports %+v, want %d to api", headless, svc.Spec.Ports, w.port)
	}
}

// checkEnv checks the node's environment: its name, its address, the token and the database.
func checkEnv(t *testing.T, m *manifest, c corev1.Container, w want) {
	t.Helper()
	names := map[string]int{}
	for i, e := range c.Env {
		if _, dup := names[e.Name]; dup {
			t.Errorf("%s set twice", e.Name)
		}
		names[e.Name] = i
	}
	if f := envVar(t, c, "DELTAGYM_NODE_NAME").ValueFrom; f == nil || f.FieldRef == nil || f.FieldRef.FieldPath != "spec.nodeName" {
		t.Errorf("DELTAGYM_NODE_NAME from %s, not spec.nodeName", dump(f))
	}
	if f := envVar(t, c, "POD_IP").ValueFrom; f == nil || f.FieldRef == nil || f.FieldRef.FieldPath != "status.podIP" {
		t.Errorf("POD_IP from %s, not status.podIP", dump(f))
	}
	advertise := fmt.Sprintf("$(POD_IP):%d", w.port)
	if w.ipv6 {
		advertise = fmt.Sprintf("[$(POD_IP)]:%d", w.port)
	}
	// $(POD_IP) expands only to a variable defined before.
	if got := envVar(t, c, "DELTAGYM_ADVERTISE_ADDR").Value; got != advertise || names["POD_IP"] > names["DELTAGYM_ADVERTISE_ADDR"] {
		t.Errorf("DELTAGYM_ADVERTISE_ADDR %q (after POD_IP: %v), want %q", got, names["POD_IP"] < names["DELTAGYM_ADVERTISE_ADDR"], advertise)
	}
	token := secretRef(t, m, c, "DELTAGYM_TOKEN", w.tokenSecret, w.tokenKey)
	if token != nil && (len(token) < 20 || strings.ContainsAny(string(token), " \t\r\n")) {
		t.Errorf("the token %q: short, or with white space", token)
	}
	if u := secretRef(t, m, c, "DELTAGYM_DATABASE_URL", w.databaseSecret, w.databaseKey); u != nil {
		if p, err := url.Parse(string(u)); err != nil || p.Scheme != "postgres" {
			t.Errorf("DELTAGYM_DATABASE_URL is no postgres URL: %v", err)
		}
	}
	for _, a := range c.Args {
		if strings.HasPrefix(a, "--token") || strings.HasPrefix(a, "--database-url") {
			t.Errorf("a secret in the process list: %s", a)
		}
	}
}

// secretRef checks that variable name comes from key of Secret secret, and returns the value
// when the chart makes that Secret (nil when it is the user's).
func secretRef(t *testing.T, m *manifest, c corev1.Container, name, secretName, key string) []byte {
	t.Helper()
	ref := envVar(t, c, name).ValueFrom
	if ref == nil || ref.SecretKeyRef == nil || ref.SecretKeyRef.Name != secretName || ref.SecretKeyRef.Key != key {
		t.Errorf("%s from %s, want key %s of Secret %s", name, dump(ref), key, secretName)
		return nil
	}
	for _, s := range m.secrets {
		if s.Name == secretName {
			v, ok := s.Data[key]
			if !ok || len(v) == 0 {
				t.Errorf("Secret %s has no %s", secretName, key)
			}
			return v
		}
	}
	if strings.HasPrefix(secretName, "rel-") {
		t.Errorf("%s names Secret %s, which the chart does not make", name, secretName)
	}
	return nil
}

// checkVolumes checks the data directory and the cgroup hierarchy, both the node's.
func checkVolumes(t *testing.T, pod corev1.PodSpec, c corev1.Container, w want) {
	t.Helper()
	mounts := map[string]corev1.VolumeMount{}
	for _, vm := range c.VolumeMounts {
		mounts[vm.MountPath] = vm
	}
	data, ok := mounts[w.dataDir]
	if !ok {
		t.Fatalf("nothing mounted at the data directory %s: %+v", w.dataDir, c.VolumeMounts)
	}
	if hp := volume(t, pod, data.Name).HostPath; hp == nil || hp.Path != w.dataDir || hp.Type == nil || *hp.Type != corev1.HostPathDirectoryOrCreate {
		t.Errorf("the data directory is not the node's %s: %+v", w.dataDir, hp)
	}
	if data.MountPropagation == nil || *data.MountPropagation != w.propagation {
		t.Errorf("the data directory's mount propagation %s, want %s", dump(data.MountPropagation), w.propagation)
	}
	cg, ok := mounts["/sys/fs/cgroup"]
	if !ok {
		t.Fatal("the host's cgroup hierarchy is not mounted")
	}
	if hp := volume(t, pod, cg.Name).HostPath; hp == nil || hp.Path != "/sys/fs/cgroup" {
		t.Errorf("/sys/fs/cgroup is not the host's: %+v", hp)
	}
}

// checkNetworkPolicy checks the nodes' policy: the API port from the other nodes; DNS, the
// other nodes and the database out.
func checkNetworkPolicy(t *testing.T, m *manifest, podLabels labels.Set, w want) {
	t.Helper()
	np := policyFor(t, m, podLabels)
	types := np.Spec.PolicyTypes
	if !slices.Contains(types, networkingv1.PolicyTypeIngress) || !slices.Contains(types, networkingv1.PolicyTypeEgress) {
		t.Errorf("policy types %v", types)
	}
	if !admits(np.Spec.Ingress, podLabels, w.port) {
		t.Errorf("the nodes' API port is closed to the other nodes:\n%s", dump(np.Spec.Ingress))
	}
	var dns, peers, database bool
	for _, r := range np.Spec.Egress {
		for _, p := range r.Ports {
			switch {
			case p.Port.IntValue() == 53 && p.Protocol != nil && *p.Protocol == corev1.ProtocolUDP:
				dns = true
			case int32(p.Port.IntValue()) == w.port && toPods(r.To, podLabels):
				peers = true
			case w.bundled && p.Port.IntValue() == 5432 && len(r.To) == 1 && r.To[0].PodSelector != nil &&
				r.To[0].PodSelector.MatchLabels["app.kubernetes.io/component"] == "postgres":
				database = true
			case !w.bundled && int32(p.Port.IntValue()) == w.externalDatabasePort:
				database = true
			}
		}
	}
	if !dns || !peers || !database {
		t.Errorf("egress: DNS %v, other nodes %v, database %v:\n%s", dns, peers, database, dump(np.Spec.Egress))
	}
}

// policyFor returns the NetworkPolicy that selects pods with labels l.
func policyFor(t *testing.T, m *manifest, l labels.Set) *networkingv1.NetworkPolicy {
	t.Helper()
	var found []*networkingv1.NetworkPolicy
	for _, np := range m.policies {
		sel, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector)
		if err != nil {
			t.Fatal(err)
		}
		if sel.Matches(l) {
			found = append(found, np)
		}
	}
	if len(found) != 1 {
		t.Fatalf("%d NetworkPolicies select %v, want 1", len(found), l)
	}
	return found[0]
}

// admits reports whether a rule of ingress admits pods with labels l of the same namespace to
// port.
func admits(ingress []networkingv1.NetworkPolicyIngressRule, l labels.Set, port int32) bool {
	for _, r := range ingress {
		if !toPods(r.From, l) {
			continue
		}
		for _, p := range r.Ports {
			if int32(p.Port.IntValue()) == port {
				return true
			}
		}
	}
	return false
}

// toPods reports whether peers name pods with labels l of the policy's own namespace.
func toPods(peers []networkingv1.NetworkPolicyPeer, l labels.Set) bool {
	for _, p := range peers {
		if p.PodSelector == nil || p.NamespaceSelector != nil || p.IPBlock != nil || len(p.PodSelector.MatchLabels) == 0 {
			continue
		}
		if sel, err := metav1.LabelSelectorAsSelector(p.PodSelector); err == nil && sel.Matches(l) {
			return true
		}
	}
	return false
}

// selects fails the test unless selector matches l.
func selects(t *testing.T, what string, selector *metav1.LabelSelector, l labels.Set) {
	t.Helper()
	sel, err := metav1.LabelSelectorAsSelector(selector)
	if err != nil {
		t.Fatal(err)
	}
	if sel.Empty() || !sel.Matches(l) {
		t.Errorf("%s selects %s, not the pods labelled %v", what, dump(selector), l)
	}
}

// one returns the only object of objs.
func one[T any](t *testing.T, kind string, objs []*T) *T {
	t.Helper()
	if len(objs) != 1 {
		t.Fatalf("%d %ss, want 1", len(objs), kind)
	}
	return objs[0]
}

func service(t *testing.T, m *manifest, name string) *corev1.Service {
	t.Helper()
	for _, s := range m.services {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("no Service %s", name)
	return nil
}

func secret(t *testing.T, m *manifest, name string) *corev1.Secret {
	t.Helper()
	for _, s := range m.secrets {
		if s.Name == name {
			return s
		}
	}
	t.Fatalf("no Secret %s", name)
	return nil
}

func volume(t *testing.T, pod corev1.PodSpec, name string) corev1.Volume {
	t.Helper()
	for _, v := range pod.Volumes {
		if v.Name == name {
			return v
		}
	}
	t.Fatalf("no volume %s", name)
	return corev1.Volume{}
}

func envVar(t *testing.T, c corev1.Container, name string) corev1.EnvVar {
	t.Helper()
	for _, e := range c.Env {
		if e.Name == name {
			return e
		}
	}
	t.Fatalf("container %s has no %s", c.Name, name)
	return corev1.EnvVar{}
}

// flag returns the value of the one --name=value of args.
func flag(t *testing.T, args []string, name string) string {
	t.Helper()
	var vals []string
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			vals = append(vals, v)
		}
	}
	if len(vals) != 1 {
		t.Fatalf("%s given %d times in %q", name, len(vals), args)
	}
	return vals[0]
}

// dump renders v as YAML, for messages.
func dump(v any) string {
	b, err := yaml.Marshal(v)
	if err != nil {
		return fmt.Sprintf("%+v", v)
	}
	return strings.TrimSpace(string(b))
}

// The notes helm prints after an install say where the token is and how to reach the nodes.
// helm template leaves them out: a client-side dry run of an install renders them.
func TestNotes(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		values string
		says   []string
	}{
		"defaults": {"", []string{"secret rel-deltagym-token -o jsonpath='{.data.token}'", "rel-deltagym-nodes.ns.svc.cluster.local:8080",
			"port-forward service/rel-deltagym 8080:8080", "the bundled Postgres"}},
		"existing secrets": {"postgres: {enabled: false}\ndatabase: {existingSecret: db}\nauth: {existingSecret: tok, existingSecretKey: k}\nservice: {enabled: false}\n",
			[]string{"secret tok -o jsonpath='{.data.k}'", "port-forward daemonset/rel-deltagym 8080:8080", "the external Postgres of Secret db"}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			args := []string{"install", release, chartDir, "--namespace", namespace, "--dry-run=client"}
			if c.values != "" {
				f := t.TempDir() + "/values.yaml"
				if err := os.WriteFile(f, []byte(c.values), 0o600); err != nil {
					t.Fatal(err)
				}
				args = append(args, "--values", f)
			}
			out, err := exec.CommandContext(t.Context(), helm(t), args...).CombinedOutput()
			if err != nil {
				t.Fatalf("helm install --dry-run=client: %v\n%s", err, out)
			}
			_, notes, ok := strings.Cut(string(out), "\nNOTES:\n")
			if !ok {
				t.Fatalf("no notes:\n%s", out)
			}
			for _, s := range c.says {
				if !strings.Contains(notes, s) {
					t.Errorf("the notes do not say %q:\n%s", s, notes)
				}
			}
		})
	}
}
