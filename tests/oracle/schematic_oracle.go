// schematic_oracle: the differential-test oracle for imgbuild's canonical
// schematic emitter. It declares the Image Factory schematic struct (field
// order and tags as siderolabs/image-factory pkg/schematic/schematic.go
// declares them) and marshals each
// input file with Go's YAML library, printing a JSON array of results.
package main

import (
	"bytes"
	"encoding/json"
	"os"
	"strings"

	"gopkg.in/yaml.v3"
)

type meta struct {
	Key   uint8  `yaml:"key"`
	Value string `yaml:"value"`
}

type customization struct {
	EmbeddedMachineConfiguration string   `yaml:"embeddedMachineConfiguration,omitempty"`
	ExtraKernelArgs              []string `yaml:"extraKernelArgs,omitempty"`
	Meta                         []meta   `yaml:"meta,omitempty"`
	SystemExtensions             struct {
		OfficialExtensions []string `yaml:"officialExtensions,omitempty"`
	} `yaml:"systemExtensions,omitempty"`
	Bootloader string `yaml:"bootloader,omitempty"`
	SecureBoot struct {
		EnrollKeys                   string `yaml:"enrollKeys,omitempty"`
		IncludeWellKnownCertificates bool   `yaml:"includeWellKnownCertificates,omitempty"`
	} `yaml:"secureboot,omitempty"`
	DiskImage struct {
		SectorSize uint `yaml:"sectorSize,omitempty"`
	} `yaml:"diskImage,omitempty"`
}

type schematic struct {
	Owner   string `yaml:"owner,omitempty"`
	Overlay struct {
		Image   string         `yaml:"image"`
		Name    string         `yaml:"name"`
		Options map[string]any `yaml:"options,omitempty"`
	} `yaml:"overlay,omitempty"`
	Customization customization `yaml:"customization"`
}

type result struct {
	Canonical string `json:"canonical"`
	Error     string `json:"error,omitempty"`
	// Reparses reports whether Go's own reader accepts the canonical bytes.
	Reparses bool `json:"reparses"`
}

func main() {
	var out []result
	for _, path := range os.Args[1:] {
		data, err := os.ReadFile(path)
		if err != nil {
			panic(err)
		}
		var s schematic
		dec := yaml.NewDecoder(bytes.NewReader(data))
		dec.KnownFields(true)
		if err := dec.Decode(&s); err != nil {
			out = append(out, result{Error: err.Error()})
			continue
		}
		s.Customization.Bootloader = strings.ToLower(s.Customization.Bootloader)
		if s.Customization.Bootloader == "none" {
			s.Customization.Bootloader = ""
		}
		b, err := yaml.Marshal(&s)
		r := result{Canonical: string(b)}
		if err != nil {
			r.Error = err.Error()
		}
		var back schematic
		r.Reparses = yaml.Unmarshal(b, &back) == nil
		out = append(out, r)
	}
	json.NewEncoder(os.Stdout).Encode(out)
}
