// Package helmtest tests the Helm chart deploy/helm/deltagym: it renders the chart with helm
// template for several value sets and checks what comes out. Every object must decode strictly
// (no unknown field, no duplicate key) into the Kubernetes API type its apiVersion and kind
// name, and an object of a kind the chart is not known to make fails the test; then the
// objects must say what a cluster of deltagym nodes needs: gRPC health probes on the API port,
// the token from a Secret, the node's name from the downward API, the peers from the headless
// Service, a drain shorter than the grace period, a privileged container with its data
// directory on the node, and a disruption budget and network policies that select the nodes.
// Value sets that must not render are refused with the message that says why.
//
// It is a Go module of its own, so that the Kubernetes API types stay out of the server's
// module. $HELM names the helm binary; `make helm-test` installs the pinned one and sets it.
package helmtest
