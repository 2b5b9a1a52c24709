// The JSON6902 oracle: applies a JSON patch to a JSON document with
// github.com/evanphx/json-patch, the library (and API: the v4 package at the
// module's root) Talos's configpatcher applies JSON6902 patches with
// (pkg/machinery/config/configpatcher/json6902.go). Debian's
// golang-github-evanphx-json-patch-dev ships it.
//
// Usage: json6902_oracle DOC.json PATCH.json > PATCHED.json
package main

import (
	"fmt"
	"os"

	jsonpatch "github.com/evanphx/json-patch"
)

func main() {
	doc, err := os.ReadFile(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	raw, err := os.ReadFile(os.Args[2])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	patch, err := jsonpatch.DecodePatch(raw)
	if err != nil {
		fmt.Fprintln(os.Stderr, "decode:", err)
		os.Exit(1)
	}
	out, err := patch.Apply(doc)
	if err != nil {
		fmt.Fprintln(os.Stderr, "apply:", err)
		os.Exit(1)
	}
	os.Stdout.Write(out)
}
